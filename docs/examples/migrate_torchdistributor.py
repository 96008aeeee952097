from pyspark.sql import SparkSession

spark = SparkSession.builder.master("local[2]").getOrCreate()


def train(lr):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    dist.destroy_process_group()  # before the process exits (gloo's threads, torchrun's agent)
    return {"lr": lr, "ranks": int(total.item())}


# before
from pyspark.ml.torch.distributor import TorchDistributor

before = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, 0.1)

# after: the same function, the same call
from sparkhvd.torch import TorchDistributor

after = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, 0.1)

# or, with arguments by name, torchrun's numbering and a run folder
from sparkhvd import SparkRunner

named = SparkRunner(np=2, backend="torch").run(train, lr=0.1)
assert before == after == named == {"lr": 0.1, "ranks": 1}, (before, after, named)
