"""The ``sparkhvd`` command: presets, doctor, run a training script, spark-submit a job."""
from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
from typing import Optional

import click

from sparkhvd.spark.presets import PresetError, list_preset_names, load_preset

__side__ = "driver"


def _console():
    from rich.console import Console

    return Console(highlight=False)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sparkhvd")
def main() -> None:
    """Horovod data-parallel TensorFlow/Keras training on Spark."""


# -- presets ------------------------------------------------------------------------------------
@main.group(invoke_without_command=True)
@click.pass_context
def presets(ctx: click.Context) -> None:
    """List session presets (conf/*.json, %%configure format) with their largest np."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.table import Table

    table = Table("preset", "max np", "executors x cores", "memory (driver/executor)", "file")
    for name in list_preset_names():
        try:
            p = load_preset(name)
        except PresetError as exc:
            table.add_row(name, "invalid", str(exc), "", "")
            continue
        b = p.body
        table.add_row(name, str(p.max_np()),
                      f"{b.get('numExecutors', 1)} x {b.get('executorCores', 1)}"
                      + (f" ({p.master})" if p.master else ""),
                      f"{b.get('driverMemory', '-')}/{b.get('executorMemory', '-')}",
                      p.path or "")
    _console().print(table)


@presets.command("show")
@click.argument("name")
@click.option("--as", "fmt", type=click.Choice(["configure", "spark-submit", "json", "conf"]),
              default="configure", show_default=True, help="How to render the preset.")
@click.option("--master", default=None, help="Master URL for --as spark-submit.")
def presets_show(name: str, fmt: str, master: Optional[str]) -> None:
    """Show preset NAME as a %%configure cell, spark-submit flags, JSON, or Spark settings."""
    try:
        p = load_preset(name)
    except PresetError as exc:
        raise click.ClickException(str(exc)) from None
    import json

    if fmt == "configure":
        click.echo(p.configure_cell())
    elif fmt == "spark-submit":
        click.echo(shlex.join(p.spark_submit_args(master)))
    elif fmt == "json":
        click.echo(json.dumps(p.body, indent=4))
    else:
        for key, value in p.spark_conf().items():
            click.echo(f"{key}={value}")


# -- doctor -------------------------------------------------------------------------------------
@main.command()
@click.option("--preset", default="local-cpu", show_default=True,
              help="Preset whose session is started (when none is active).")
@click.option("--master", default=None, help="Spark master URL to check, e.g. spark://HOST:7077 "
              "(overrides the preset's).")
@click.option("--remote", default=None, help="Spark Connect URL to check instead, e.g. "
              "sc://HOST:15002 (or local[2]: a local Connect server).")
@click.option("--np", "np_", type=int, default=None, help="Ranks you plan to run (default: 2).")
@click.option("--storage-url", default=None, help="Also pre-flight this output URL.")
def doctor(preset: str, master: Optional[str], remote: Optional[str], np_: Optional[int],
           storage_url: Optional[str]) -> None:
    """Check the stack, Java, a Spark session, its slots, the cluster's network and storage.

    With a cluster session, one barrier stage of NP tasks reports each host, the interface Gloo
    will use there, and whether it reaches the driver.
    """
    from sparkhvd.ops import doctor as doc

    logging.getLogger("py4j").setLevel(logging.ERROR)
    rows = doc.stack_checks()
    needed = np_ or 2
    session: dict = {}

    def start() -> str:
        from sparkhvd.spark.sparkview import SparkView

        if remote:
            from sparkhvd.spark.session import connect_session

            session["spark"] = connect_session(remote)
        else:
            from pyspark import SparkContext

            from sparkhvd.spark.session import get_or_create_session

            session["created"] = SparkContext._active_spark_context is None
            p = load_preset(preset)
            if master:
                p.conf["spark.master"] = master
            session["spark"] = get_or_create_session(needed, preset=p)
        view = SparkView(session["spark"])
        return f"{view.describe()} (Spark {view.version}, {view.kind} session)"

    rows.append(doc.check("Spark session", start,
                          "check Java and pyspark; for a cluster, check the master URL"))
    hosts = None
    if "spark" in session:
        more, hosts = doc.cluster_checks(session["spark"], needed)
        rows += more
    if storage_url:
        def probe() -> str:
            from sparkhvd.storage import preflight, public_url

            preflight(storage_url)
            return f"{public_url(storage_url)} writable"

        rows.append(doc.check("storage", probe,
                              "check the URL, AZURE_STORAGE_* credentials and permissions"))
    _print_checks(rows, hosts)
    if session.get("created"):
        session["spark"].stop()
    if any(not r.ok and not r.optional for r in rows):
        raise SystemExit(1)


def _print_checks(rows: list, hosts: Optional[list]) -> None:
    """doctor's table of checks, and (on a cluster) the table of its tasks."""
    from rich.table import Table

    table = Table("check", "status", "detail", "fix")
    for row in rows:
        status = "[green]ok[/]" if row.ok else "[yellow]n/a[/]" if row.optional else "[red]FAIL[/]"
        table.add_row(row.name, status, row.detail, row.fix)
    console = _console()
    console.print(table)
    if hosts:
        tasks = Table("task", "host", "Gloo interface", "reaches the driver", "Spark driver port")
        for r in hosts:
            tasks.add_row(str(r["partition"]), r["host"], r["iface"], r["driver"], r["spark"])
        console.print(tasks)


# -- run / submit -------------------------------------------------------------------------------
@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("script", type=click.Path(exists=True, dir_okay=False))
@click.option("--np", "np_", type=int, required=True, help="Ranks (negative: local processes).")
@click.option("--preset", default=None, help="Session preset for the Spark session.")
@click.option("--output-dir", default="runs", show_default=True, help="Run folders go here.")
@click.option("--verbosity", type=click.Choice(["rank0", "all"]), default="rank0",
              show_default=True, help="Which ranks' output the console shows.")
@click.option("--backend", type=click.Choice(["horovod", "tf", "torch"]), default="horovod",
              show_default=True, help="horovod (Gloo); tf: TF_CONFIG for tf.distribute; torch: "
              "torchrun's MASTER_ADDR/RANK/WORLD_SIZE/LOCAL_RANK for torch.distributed.")
@click.option("--remote", default=None, help="Run on a Spark Connect session: sc://HOST:15002 "
              "(or local[N] for a local Connect server), where --master/--preset take a "
              "classic one.")
@click.option("--ranks-per-task", type=int, default=1, show_default=True,
              help="Ranks each Spark task starts (one per GPU of the task); np counts ranks.")
@click.option("--local-ranks", type=click.Choice(["host", "task"]), default=None,
              help="What LOCAL_RANK counts: host (torchrun's numbering, the default with one "
              "rank per task) or task (TorchDistributor's: every Spark task its own node).")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def run(script: str, np_: int, preset: Optional[str], output_dir: str, verbosity: str,
        backend: str, remote: Optional[str], ranks_per_task: int, local_ranks: Optional[str],
        script_args: tuple[str, ...]) -> None:
    """Run a plain training SCRIPT on Spark, as horovodrun or torchrun would:
    sparkhvd run train.py --np 2 [--backend torch] -- ARGS."""
    from sparkhvd.common.errors import SparkhvdError
    from sparkhvd.common.script import read_script, run_script
    from sparkhvd.driver.runner import HorovodRunner

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("sparkhvd").setLevel(logging.INFO)
    try:
        spark = None
        if remote:
            from sparkhvd.spark.session import connect_session

            spark = connect_session(remote)
        runner = HorovodRunner(np=np_, preset=preset, output_dir=output_dir, spark=spark,
                               driver_log_verbosity=verbosity, backend=backend,
                               ranks_per_task=ranks_per_task, local_ranks=local_ranks)
        runner.run(run_script, source=read_script(script), path=script, argv=list(script_args))
    except (SparkhvdError, ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
    assert runner.last_run_dir is not None
    click.echo(f"run folder: {runner.last_run_dir.url}")


@main.command()
@click.argument("run_folder", type=click.Path(exists=True, file_okay=False))
@click.option("--timeout", type=float, default=30.0, show_default=True,
              help="Seconds to wait for the running driver's answer.")
def stacks(run_folder: str, timeout: float) -> None:
    """Print every rank's Python stacks (all threads) of a run that is running now, with which
    rank waits in a collective and which is elsewhere: sparkhvd stacks runs/<run-id>. Also
    saved as logs/stacks-<time>.txt in the run folder."""
    from sparkhvd.driver.monitor import request_stacks

    try:
        click.echo(request_stacks(run_folder, timeout=timeout))
    except (FileNotFoundError, TimeoutError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.argument("run_folder", type=click.Path(exists=True, file_okay=False))
def report(run_folder: str) -> None:
    """Write report.html into a run folder (a local one; every run writes its own at the end):
    attempts, throughput, each rank's time split, stragglers, system metrics, curves, logs.
    One static file that works offline: sparkhvd report runs/<run-id>."""
    from sparkhvd.timing.report import write_report

    if not os.path.exists(os.path.join(run_folder, "run.json")):
        raise click.ClickException(f"{run_folder} has no run.json: pass a run folder "
                                   "(runs/<run-id>)")
    click.echo(write_report(run_folder))


def spark_submit_command(preset: str, master: Optional[str], job: str,
                         job_args: tuple[str, ...] = ()) -> list[str]:
    """The full ``spark-submit`` command line for a job under a preset."""
    import pyspark

    p = load_preset(preset)
    submit = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    # Spark's INFO lines (some 90 of them while the context starts) and its stage progress bar
    # (drawn into the ranks' lines for as long as the barrier stage runs) would bury the job's
    # own output: off, unless the preset says otherwise (spark.log.level: Spark >= 3.5).
    quiet = [arg for key, value in (("spark.log.level", "WARN"),
                                    ("spark.ui.showConsoleProgress", "false"))
             if key not in p.conf for arg in ("--conf", f"{key}={value}")]
    return [submit, *p.spark_submit_args(master), *quiet,
            "--conf", f"spark.pyspark.python={sys.executable}",
            "--conf", f"spark.pyspark.driver.python={sys.executable}",
            job, *job_args]


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--preset", required=True, help="Session preset (conf/NAME.json).")
@click.option("--master", default=None, help="Master URL, e.g. spark://127.0.0.1:7077.")
@click.option("--dry-run", is_flag=True, help="Print the spark-submit command and exit.")
@click.argument("job", type=click.Path(exists=True, dir_okay=False))
@click.argument("job_args", nargs=-1, type=click.UNPROCESSED)
def submit(preset: str, master: Optional[str], dry_run: bool, job: str,
           job_args: tuple[str, ...]) -> None:
    """spark-submit JOB with a preset's resources: sparkhvd submit --preset standalone-cpu --master spark://HOST:7077 job.py ARGS."""
    try:
        command = spark_submit_command(preset, master, job, job_args)
    except PresetError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(shlex.join(command))
    if dry_run:
        return
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    raise SystemExit(subprocess.call(command, env=env))


if __name__ == "__main__":  # pragma: no cover
    main()
