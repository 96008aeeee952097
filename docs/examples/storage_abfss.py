import sparkhvd
from sparkhvd import SparkRunner

conn = "DefaultEndpointsProtocol=https;AccountName=myaccount;AccountKey=...;"
options = {"connection_string": conn}  # used on the driver only, never sent to a rank


def train(epochs):
    return b"rank 0's bytes after %d epochs" % epochs


hr = SparkRunner(np=-2, backend="tf", storage_options=options,
                 output_dir="abfss://models@myaccount.dfs.core.windows.net/runs")
result = hr.run(train, epochs=3)
print(hr.last_run_dir.url)  # the run folder, published: run.json, logs/, result.bin
print(sparkhvd.storage.read_bytes(hr.last_run_dir.url + "/result.bin", options))
