from pyspark.sql import SparkSession

from sparkhvd import SparkRunner

# "sc://my-cluster:15002" on a cluster; "local[2]" starts a local Spark Connect server
spark = SparkSession.builder.remote("local[2]").getOrCreate()


def train(epochs):
    import os

    return {"tf_config": os.environ["TF_CONFIG"], "epochs": epochs}


result = SparkRunner(np=2, backend="tf", spark=spark).run(train, epochs=5)
print(result)
