import torch
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits

import sparkhvd.torch as st
from sparkhvd import DataFrameDataset, SparkRunner

spark = SparkSession.builder.master("local[2]").getOrCreate()
digits = load_digits()
rows = [(row.tolist(), int(label)) for row, label in zip(digits.data / 16.0, digits.target)]
df = spark.createDataFrame(rows, "features array<float>, label long").orderBy("label")  # sorted


def train(data, epochs, stop_after=None):
    ctx = st.setup()
    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = st.Checkpoints(model, opt, data=data)       # the data's position rides along
    for epoch in range(ckpt.restore(), epochs):         # a mid-epoch checkpoint: that epoch
        for x, y in data.torch_batches(32, epoch, shuffle=True, seed=1):  # ...from its next step
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            step = data.position.step                   # steps of this epoch done
            if step % 10 == 0:
                ckpt.save(epoch, step=step)             # checkpoints/epoch-0000-step-0000010.pt
            if stop_after is not None and step == stop_after:
                return None                             # (as if the node went away)
        ckpt.save(epoch)
    return loss.item()


data = DataFrameDataset(df, "features", "label")
SparkRunner(np=2, backend="torch", output_dir="runs").run(train, data=data, epochs=2,
                                                            stop_after=20)
resumed = SparkRunner(np=1, backend="torch", output_dir="runs", resume_from=True)
loss = resumed.run(train, data=data, epochs=2)          # the rest of epoch 0 on one rank
print("resumed from", resumed.last_run_dir.record["resume"], f"loss {loss:.3f}")
