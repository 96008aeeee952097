import os
import signal

import torch
from pyspark.sql import SparkSession

import sparkhvd.torch as st
from sparkhvd import DataFrameDataset, SparkRunner

spark = SparkSession.builder.master("local[2]").getOrCreate()
df = spark.range(4000).selectExpr(
    "id", "array(CAST(id % 7 AS FLOAT), CAST(id % 5 AS FLOAT)) AS x",
    "CAST(id % 7 + 2 * (id % 5) AS FLOAT) AS y")


def train(data, epochs, lr):
    ctx = st.setup()
    before, now = st.world_size_change()         # after a resize: (old size, new size)
    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr * now)   # the per-sample rule, re-derived
    ckpt = st.Checkpoints(model, opt, data=data, every_steps=20, keep=3)
    for epoch in range(ckpt.restore(), epochs):  # a mid-epoch checkpoint: from its next step
        for x, y in data.torch_batches(16, epoch, shuffle=True, seed=0):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
            opt.step()
            if (os.environ["TORCHELASTIC_RESTART_COUNT"], ctx.rank, epoch,
                    data.position.step) == ("0", 1, 0, 30):
                os.kill(os.getpid(), signal.SIGTERM)  # what a spot node gets before it goes
            ckpt.step(epoch)                     # every 20 steps -- and at once on a notice
        ckpt.save(epoch)
    return {"world": now, "was": before}


runner = SparkRunner(np=2, min_np=1, max_np=2, backend="torch", output_dir="runs")
with DataFrameDataset(df, "x", "y") as data:
    print(runner.run(train, data=data, epochs=2, lr=0.005))
record = runner.last_run_dir.record
print([(s["state"], s.get("checkpoint")) for s in record["states"]])
