"""sparkhvd benchmarks (``make bench``, ``make bench CASE=B1``): JSON, a Markdown table, a chart.

Cases (each run ``--repeat`` times; median, min and max are reported):

- B1C launch on Spark Connect: the same no-op through a Connect client vs a classic session
  (modern profile: ``make bench CASE=B1C PROFILE=modern``)
- B1T PyTorch launch: a no-op that joins the process group, np=2, sparkhvd (backend='torch') vs
  Spark's TorchDistributor (torch profile: ``make bench CASE=B1T PROFILE=torch``)
- B8 PyTorch training throughput: the same DDP loop on the digits through both (torch profile)
- B1 launch overhead: a no-op at np=2 on a warm local[2] session, sparkhvd vs raw
  ``horovod.spark.run`` vs the floor (a plain 2-task Spark job that starts a Python process per
  task); also with a function that imports TensorFlow; and ``backend="tf"`` (no-op, and a
  function that builds the MultiWorkerMirroredStrategy).
- B2 data throughput: rows/s of one rank (rank 0 of 2) feeding tf.data from a Spark DataFrame of
  784-float rows: sparkhvd's DataFrameDataset vs petastorm's ``make_tf_dataset`` (defaults) vs
  the ceiling of pyarrow reading the same Parquet in-process.
- B2T the PyTorch data path: rows/s of one rank feeding torch from the same DataFrame:
  ``torch_batches`` and ``torch_dataset`` through a DataLoader vs the pyarrow ceiling, petastorm's
  ``make_torch_dataloader`` and TorchDistributor's DataFrame input; peak RSS at 100k vs 800k rows.
  ``make bench`` puts torch into the default profile for it (petastorm needs that profile's
  pyarrow).
- B3 scaling on every backend (horovod, tf, torch): training samples/s of a fixed CNN on
  synthetic data, np=1 vs np=2 (one thread per rank) vs two independent ranks (the machine
  ceiling), at 64 and 256 rows per rank per step, taking turns; efficiency = thr(2) / (2 x
  thr(1)); the profile (compute per step, the gradient allreduce alone); a few horovod settings.
- B11 launch cost as np grows: a no-op at np 2/4/8/16 on local[16] per backend against the
  floor, with where the time goes (Spark stage, rank start-up, import torch, rendezvous, end).
- B4 storage: a 200 MB model written and read back on Azurite through sparkhvd.storage vs the
  Azure blob SDK directly (at least 9 runs each: Azurite is noisy).
- B5 GPU: ResNet-50 images/s through sparkhvd (backend='torch', one local rank per GPU, DDP
  over nccl) vs the same loop in a plain process; B5D the same loop fed from a
  ``DataFrameDataset`` (int8 images, streamed and shuffled, ``torch_batches(device='cuda')``)
  vs synthetic images on the GPU (goal 0.9x); the Keras form needs TensorFlow with a GPU;
  a checkpoint every step of a model with 6.4 GB of state on the GPU (``bench/b15.py``): how
  long the device-to-host copy holds a step, sync vs ``async_save=True`` vs none.
  Recorded as skipped where there is none.
- B6 streaming: one shuffled epoch on 2 ranks at 100k/400k/800k rows x 784 float32: peak RSS
  (``ru_maxrss``) and rows/s per rank; in memory vs streamed at 100k.
- B7 scoring: ``sparkhvd.predict`` on local[2] executors vs collecting the rows to the driver
  and calling ``model.predict``, rows/s.
- B10 a real client's throughput: a Hugging Face Trainer through sparkhvd's TorchDistributor
  drop-in and through Spark's (torch profile)
- B12 recovery (torch profile): a lost rank (SIGKILL) or a notice (SIGTERM) at np=2 -- seconds
  to the first step after the relaunch, and the steps each rank trained twice -- with epoch
  checkpoints only (``max_retries`` before step checkpoints), step checkpoints every 10 steps,
  and a notice.
- B13 the time split's cost: B3's CNN at np=2 with the sampler on and off, taking turns, and
  the sampler's work per sample (goal: on >= 0.98 x off).
- B14 what a rank reads of a DataFrameDataset per epoch (bytes over its share, np 1-8), locally
  and on the test cluster from Azurite, peak RSS over the kept share, and label diversity on
  sorted data (``bench/b14.py``).
- B15 a checkpoint every step (torch profile): steps/s with none, synchronous and
  ``async_save=True`` checkpoints of a model with about 1 GB of state, and how long a save holds
  a step (``bench/b15.py``; goal: async >= 0.95 x none); the restore from this host's copy,
  another rank's, a local folder and ``abfss://`` on Azurite (goal: host copy <= 0.5 x abfss).
- B9 an over-partitioned DataFrame (2,000 rows in 1,000 partitions): materialise + one epoch at
  np=2, partitions merged into one wave of write tasks vs one Parquet file per partition.

B2 and B4 warm every variant up once, then let the variants take turns.

No benchmark runs in the test suite; tests/integration/test_bench.py runs the harness and some
cases on tiny inputs (``--tiny`` runs every case so).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
from pathlib import Path

import b1
import b1t
import b2
import b2t
import b3
import b4
import b5
import b6
import b7
import b9
import b11
import b12
import b13
import b14
import bench_common
import click
import cloudpickle
import readme_table
from b2 import b2_frame
from b11 import session_of
from bench_common import ROOT, stats
from bench_report import write_chart, write_markdown


def _by_value() -> None:
    """A case's functions travel to the ranks by value, so a rank need not find these modules:
    through sparkhvd's cloudpickle and through Spark's own (TorchDistributor, petastorm)."""
    picklers = [cloudpickle]
    with contextlib.suppress(ImportError):
        from pyspark import cloudpickle as spark_cloudpickle

        picklers.append(spark_cloudpickle)
    for pickler in picklers:
        for module in (bench_common, b1, b1t, b2, b2t, b3, b4, b5, b6, b7, b9, b11, b12, b13,
                       b14):
            pickler.register_pickle_by_value(module)


_by_value()

def case_b14(repeat: int, tiny: bool) -> list[dict]:
    return b14.case_b14(repeat, tiny, session_of, b2_frame)


def case_b15(repeat: int, tiny: bool) -> list[dict]:
    import b15

    return b15.case_b15(repeat, tiny, stats)


#: Each case: ``(repeat, tiny) -> rows``, in the report's order (one module each: ``bN.py``).
CASES = {"B1": b1.case_b1, "B1C": b1.case_b1c, "B1T": b1t.case_b1t, "B2": b2.case_b2,
         "B2T": b2t.case_b2t, "B3": b3.case_b3, "B4": b4.case_b4, "B5": b5.case_b5,
         "B6": b6.case_b6, "B7": b7.case_b7, "B8": b1t.case_b8, "B9": b9.case_b9,
         "B10": b1t.case_b10, "B11": b11.case_b11, "B12": b12.case_b12, "B13": b13.case_b13,
         "B14": case_b14, "B15": case_b15}


def environment() -> dict:
    from sparkhvd.runfolder.rundir import versions

    return {"date": _dt.datetime.now().isoformat(timespec="seconds"), "cores": os.cpu_count(),
            "machine": platform.machine(), "spark_master": "local[2]", "np": 2,
            "versions": versions()}


@click.command()
@click.option("--case", "cases", multiple=True, type=click.Choice(list(CASES)),
              help="Run only these cases (default: all).")
@click.option("--repeat", default=3, show_default=True)
@click.option("--tiny", is_flag=True, help="Tiny inputs: checks that the code runs (tests).")
@click.option("--out", "out_dir", default=str(ROOT / "bench"), show_default=True)
@click.option("--report", is_flag=True,
              help="Only rewrite RESULTS.md and results.png from the latest results JSON.")
def main(cases: tuple[str, ...], repeat: int, tiny: bool, out_dir: str, report: bool) -> None:
    """Run the benchmarks and write results/<date>.json, RESULTS.md and results.png."""
    if report:
        out = Path(out_dir)
        latest = json.loads(sorted((out / "results").glob("*.json"))[-1].read_text())
        write_markdown(out / "RESULTS.md", latest["env"], latest["results"])
        write_chart(out / "results.png", latest["results"])
        readme_table.main([])  # README's table, made from RESULTS.md's goals
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import logging

    logging.basicConfig(level=logging.WARNING)
    env = environment()
    out = Path(out_dir)
    (out / "results").mkdir(parents=True, exist_ok=True)
    previous = sorted((out / "results").glob("*.json"))
    earlier = [] if tiny or not previous else json.loads(previous[-1].read_text())["results"]
    result_file = out / "results" / f"{env['date'].replace(':', '-')}.json"
    rows: list[dict] = []
    failed = []
    for name in cases or CASES:
        click.echo(f"== {name}", err=True)
        try:
            new = CASES[name](repeat, tiny)
        except Exception as exc:  # noqa: BLE001 - one case must not lose the others' numbers
            failed.append(name)
            new = [{"case": name, "variant": "failed", "unit": "-",
                    "skipped": f"failed: {type(exc).__name__}: {str(exc)[:200]}"}]
        for r in new:
            r["measured"] = env["date"]
        rows += new
        for r in new:
            click.echo(f"   {r['variant']}: " + (f"{r['median']:.4g} {r['unit']}"
                                                  if "median" in r else r["skipped"]), err=True)
        # saved after every case (the cases not run this time keep their latest numbers)
        ran = {r["case"] for r in rows}
        merged = sorted([r for r in earlier if r["case"] not in ran] + rows,
                        key=lambda r: list(CASES).index(r["case"]))
        result_file.write_text(json.dumps({"env": env, "results": merged}, indent=2))
    write_markdown(out / "RESULTS.md", env, merged)
    write_chart(out / "results.png", merged)
    readme_table.main([])  # README's table, made from RESULTS.md's goals
    click.echo(f"wrote {out / 'RESULTS.md'} and README.md's table", err=True)
    if failed:
        raise SystemExit(f"case(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
