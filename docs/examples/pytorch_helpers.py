import torch
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits

import sparkhvd
import sparkhvd.torch as st
from sparkhvd import DataFrameDataset, SparkRunner

spark = SparkSession.builder.master("local[2]").getOrCreate()
digits = load_digits()
rows = [(row.tolist(), int(label)) for row, label in zip(digits.data / 16.0, digits.target)]
df, test_df = spark.createDataFrame(rows, "features array<float>, label long") \
    .randomSplit([0.8, 0.2], seed=1)


class Net(torch.nn.Module):  # your own class, defined in your script or notebook
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                          torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.layers(x)


def train(data, epochs, lr):
    ctx = st.setup()                                   # init_process_group(): gloo, or nccl on GPUs
    torch.manual_seed(0)
    model = ctx.wrap(Net())                            # DistributedDataParallel on this rank's device
    opt = torch.optim.SGD(model.parameters(), lr=ctx.scale_lr(lr))
    ckpt = st.Checkpoints(model, opt)                  # rank 0 -> <run folder>/checkpoints/
    for epoch in range(ckpt.restore(), epochs):        # resume_from=True continues exactly
        for x, y in data.torch_batches(32, epoch, shuffle=True, seed=1):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        st.report(epoch, loss=float(loss))             # rank-averaged: [rank 0] line, metrics.csv
        ckpt.save(epoch)
    example = next(data.torch_batches(1))[0]           # one batch: a class of your script has no
    return st.model_bytes(model, example_input=example) if ctx.rank == 0 else None  # source file


runner = SparkRunner(np=2, backend="torch")
runner.run(train, data=DataFrameDataset(df, "features", "label"), epochs=5, lr=0.05)
scored = sparkhvd.predict(test_df, runner.last_run_dir, features="features", argmax=True)
print(f"accuracy {scored.where('prediction = label').count() / scored.count():.3f}")
