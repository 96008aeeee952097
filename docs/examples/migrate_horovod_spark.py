from pyspark.sql import SparkSession

spark = SparkSession.builder.master("local[2]").getOrCreate()


def train(lr):
    import horovod.tensorflow as hvd

    hvd.init()
    return {"lr": lr, "rank": hvd.rank(), "size": hvd.size()}


# before
import horovod.spark

before = horovod.spark.run(train, args=(0.1,), num_proc=2, use_gloo=True)[0]

# after: the same function
from sparkhvd import HorovodRunner

after = HorovodRunner(np=2).run(train, lr=0.1)
assert before == after == {"lr": 0.1, "rank": 0, "size": 2}, (before, after)
