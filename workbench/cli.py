"""`workbench` command line: run the pipeline, show the configuration, list the steps, check what this machine can
run, serve a deployment, sweep many runs and compare them."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import warnings
from pathlib import Path

import yaml

from workbench.core.config import RunConfig
from workbench.core.errors import ConfigError, RunInterruptedError, WorkbenchError
from workbench.core.record import RunRecord, StepStatus
from workbench.models.pins import project_version
from workbench.serving.server import API_PORT, HOST
from workbench.steps import specs

SERVE_PORTS = (8000, 8001, 8002)  # tritonserver's own defaults, as in the triton step's deployment files


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML run configuration")
    parser.add_argument("--model", help="HF model id or local folder (default: the embedded all-MiniLM-L6-v2)")
    parser.add_argument("--steps", help="comma-separated steps to run, e.g. export,optimize")
    parser.add_argument("--output-dir", help="run folder (default: outputs/<timestamp>-<model>)")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                        help="override one setting; dotted keys for nested ones (batch.max=16); repeatable")


def _load_config(args: argparse.Namespace) -> RunConfig:
    """The configuration from defaults (or the resumed run's), --config, the named options and -p overrides."""
    overrides = list(args.param)
    for key in ("model", "output_dir"):
        if getattr(args, key):
            overrides.append(f"{key}={getattr(args, key)}")
    if args.steps:
        overrides.append(f"steps=[{', '.join(n.strip() for n in args.steps.split(',') if n.strip())}]")
    base = None
    if getattr(args, "resume", False):
        if not args.output_dir:
            raise ConfigError("--resume needs the run folder", "pass --output-dir <the run to continue>")
        base = RunRecord.load(args.output_dir).settings  # as stored: a -p below may mend a value that no longer loads
    with warnings.catch_warnings(record=True) as moved:
        warnings.simplefilter("always", FutureWarning)
        config = RunConfig.load(args.config, overrides, base=base)
    for warning in moved:  # a moved key: one line, not Python's file and source line
        print(f"note: {warning.message} (the old key still works)", file=sys.stderr)
    return config


def _run(args: argparse.Namespace) -> int:
    from workbench.pipeline import run_pipeline
    from workbench.steps import verdict_line

    config = _load_config(args)
    record = run_pipeline(config, overwrite=args.overwrite, progress=not args.quiet, resume=args.resume)
    print(f"{'step':12s} {'status':19s} {'seconds':>8} {'peak':>8} detail")
    for step in record.step_entries():
        peak = f"{step.peak_mb:.0f} MB" if step.peak_mb else ""
        print(f"{step.name:12s} {step.label:19s} {step.seconds or '':>8} {peak:>8} {step.detail}")
        if step.status == StepStatus.OK:  # what it found: its notebook's last cell
            for line in verdict_line(step.name, record).splitlines():
                print(f"{'':12s} {line}")
    print(f"run.json: {record.path}")
    return 0


def _show_config(args: argparse.Namespace) -> int:
    print(yaml.safe_dump(_load_config(args).to_params(), sort_keys=False), end="")
    return 0


def _list_steps(args: argparse.Namespace) -> int:
    if args.write_parameter_cells:
        from workbench.report.notebook import write_parameter_cells

        for written in write_parameter_cells():
            print(f"rewrote the parameters cell of {written}", file=sys.stderr)
    for step in specs():
        settings = f" (settings: {step.name}.*)" if step.settings else ""
        print(f"{step.name:12s} notebooks/{step.notebook:24s} {step.summary}{settings}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from workbench.doctor import run_checks, step_support

    findings = run_checks()
    print(f"workbench {project_version()}: what this machine has")
    for finding in findings:
        print(f"  {finding.line()}")
    print("steps")
    for support in step_support(findings):
        print(f"  {support.line()}")
    return 0


def _run_epilog() -> str:
    """`run --help`'s closing text: the steps (from the step list) and two typical commands."""
    steps = "\n".join(f"  {step.name:12s} {step.summary}" for step in specs())
    return (f"steps, in run order (--steps takes any of them, comma-separated):\n{steps}\n\n"
            "examples:\n"
            "  workbench run --steps export,optimize\n"
            "      the embedded all-MiniLM-L6-v2: export it to ONNX and optimize it, in outputs/<timestamp>-<model>\n"
            "  workbench run --resume --output-dir outputs/<run> --steps tensorrt\n"
            "      on an NVIDIA GPU host: build the TensorRT engines of a run made on another machine")


def _install_perf_analyzer(args: argparse.Namespace) -> int:
    from workbench.measure.perf_analyzer import install_perf_analyzer

    tool = install_perf_analyzer()
    print(f"perf_analyzer: {tool.executable}")
    return 0


def _lab(args: argparse.Namespace) -> int:
    from workbench.lab import lab

    return lab(args.jupyter_args)


def _serve(args: argparse.Namespace) -> int:
    from workbench.serve import api_keys, checked_repository, run_repository, serve
    from workbench.serving.backend.api_schema import KEY_VARIABLE

    keys = api_keys(args.api_key, "--api-key") if args.api_key is not None else \
        api_keys(os.environ.get(KEY_VARIABLE, ""), KEY_VARIABLE)
    repository = run_repository(Path(args.run)) if args.run else \
        checked_repository(Path(args.repository), args.unverified)
    return serve(repository, args.host, (args.http_port, args.grpc_port, args.metrics_port),
                 None if args.no_api else args.api_port, keys, args.api_workers)


def _sweep(args: argparse.Namespace) -> int:
    from workbench.sweep import load_sweep, local_models, run_sweep, write_manifest

    sweep = load_sweep(Path(args.file), Path(args.output_root) if args.output_root else None)
    if args.kubernetes or args.kuberay:
        if args.kubernetes:
            print(f"Indexed Job of {len(sweep.runs)} runs: {write_manifest(sweep, Path(args.kubernetes))}")
        else:
            from workbench.fleet.kuberay import write_kuberay

            print(f"RayCluster and RayJob of {len(sweep.runs)} runs: {write_kuberay(sweep, Path(args.kuberay))}")
        local = local_models(sweep)
        if local:
            print(f"warning: {len(local)} model(s) are paths on this machine, which the pods see only where the "
                  f"image or the claim holds them at that path ({'; '.join(local)}): use hub ids, or put the "
                  "models into kubernetes.image at those paths", file=sys.stderr)
        return 0
    ray = sweep.spec.ray
    address = args.ray or (ray.address if ray else None)
    if address:
        from workbench.fleet.driver import run_on_cluster

        return run_on_cluster(sweep, address, ray.kinds if ray else None, ray.retries if ray else 1)
    return run_sweep(sweep, args.index, progress=not args.quiet)


def _node(args: argparse.Namespace) -> int:
    from workbench.fleet.node import plan_start, run_node

    if args.head == bool(args.address):
        raise ConfigError("pass --head (this node starts the cluster) or --address HOST:PORT (it joins one)",
                          "one of the two")
    start = plan_start(args.address, args.port, args.kind, args.num_cpus, args.ip, args.temp_dir,
                       args.object_store_mb)
    how = "told" if start.told else "from this CPU's flags"
    print(f"host kind {start.kind.name} ({how}: {start.kind.about}); advertising {start.resources}", flush=True)
    if args.dry_run:
        print(shlex.join(start.argv))
        return 0
    print(f"node running (pid {os.getpid()}); Ctrl-C or `kill {os.getpid()}` stops it with all its processes",
          flush=True)
    return run_node(start)


def _compare(args: argparse.Namespace) -> int:
    from workbench.core.config import outputs_root
    from workbench.report.compare import bench_command, compare, find_runs, write_compare

    runs = find_runs([Path(p) for p in args.runs])
    compared = compare(runs, args.min_cosine)
    written = write_compare(compared, Path(args.output) if args.output else outputs_root() / "compare",
                            args.overwrite)
    for found in compared.groups:
        print(found.host)
        for pick in found.picks:
            chosen = f"{pick.run}: {pick.variant} ({pick.value})" if pick.variant else f"none: {pick.reason}"
            print(f"  {pick.goal:10s} {chosen}  [{pick.rule}]")
        if found.unmeasured and found.latency_cell:
            print(f"  not picked (no bench): {', '.join(found.unmeasured)}; `{bench_command('<run>')}` measures one")
    for row in compared.fleet:
        chosen = f"{row.run}: {row.variant} ({row.value}, {row.speedup:.3g}x PyTorch, margin {row.margin:+.2g})" \
            if row.variant and row.speedup is not None and row.margin is not None else f"none: {row.reason}"
        print(f"fleet: {row.kind:12s} {Path(row.model).name} {row.goal:10s} {chosen}"
              + (f" at {row.cell.replace('_', ' ')}" if row.cell and row.variant else ""))
    for label, why in compared.left_out.items():
        print(f"{label}: no row: {why}")
    shown = len(runs) - len(compared.left_out)
    print(f"{len(runs)} runs given, {shown} compared: {', '.join(str(p.resolve()) for p in written.values())}")
    return 0


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0-65535; 0 picks a free one)")
    return port


def _positive(text: str) -> int:
    count = int(text)
    if count < 1:
        raise argparse.ArgumentTypeError(f"{count}: give 1 or more")
    return count


def _serve_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="RUN_FOLDER", help="serve what this run's triton step deployed")
    source.add_argument("--repository", metavar="PATH", help="serve this Triton model repository")
    parser.add_argument("--host", default=HOST, help=f"address to listen on (default {HOST}: this machine only; "
                        "0.0.0.0 is every interface, with a warning)")
    for protocol, default in zip(("http", "grpc", "metrics"), SERVE_PORTS):
        parser.add_argument(f"--{protocol}-port", type=_port, default=default, metavar="PORT",
                            help=f"default {default}, as tritonserver's own; 0 picks a free one")
    parser.add_argument("--api-port", type=_port, default=API_PORT, metavar="PORT", help=(
        f"the API front (OpenAI's, Cohere's and text-embeddings-inference's routes; docs/api.md): default "
        f"{API_PORT}; 0 picks a free one"))
    parser.add_argument("--api-workers", type=_positive, default=1, metavar="N", help=(
        "processes of the API front, accepting on its one port (default 1; more where the front's own CPU is the "
        "bottleneck: docs/api.md)"))
    parser.add_argument("--no-api", action="store_true", help="serve Triton's own protocol only, no API front")
    parser.add_argument("--unverified", action="store_true", help=(
        "with --repository: serve a repository the workbench wrote even where files changed since its triton step "
        "checked them"))
    parser.add_argument("--api-key", metavar="KEY", help=(
        "the key the API front asks for (Authorization: Bearer KEY); default: $WORKBENCH_API_KEY, else none (the "
        "variable keeps it out of the process list)"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {project_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the step notebooks through papermill and write run.json",
                         epilog=_run_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _config_args(run)
    run.add_argument("--overwrite", action="store_true", help="reuse an output dir that already holds files")
    run.add_argument("--resume", action="store_true",
                     help="continue the run in --output-dir (same model), e.g. --steps tensorrt on a GPU host")
    run.add_argument("--quiet", action="store_true", help="no progress bars or progress lines")
    run.set_defaults(func=_run)
    show = sub.add_parser("config", help="print the resolved run configuration as YAML")
    _config_args(show)
    show.set_defaults(func=_show_config)
    steps = sub.add_parser("steps", help="list the pipeline steps")
    steps.add_argument("--write-parameter-cells", action="store_true",
                       help="rewrite the parameters cell of every step notebook from the run configuration's settings "
                            "(after a setting changes), then list the steps")
    steps.set_defaults(func=_list_steps)
    sub.add_parser("doctor", help="what this machine can run and why not: GPU, ONNX Runtime providers, TensorRT, "
                   "tritonserver, perf_analyzer, libraries, with versions").set_defaults(func=_doctor)
    sub.add_parser("install-perf-analyzer", help="put NVIDIA's perf_analyzer into this environment (tools/, and a "
                   "perf_analyzer wrapper in bin/)").set_defaults(func=_install_perf_analyzer)
    sweep = sub.add_parser("sweep", help="many runs from one YAML file, one after another (resumable), or the "
                           "same file as a Kubernetes Indexed Job")
    sweep.add_argument("file", help="the sweep file (docs/compare.md)")
    sweep.add_argument("--output-root", help="where the run folders go (default: the file's output_root)")
    sweep.add_argument("--index", type=int, help="run only this run (0-based; an Indexed Job's pods pass theirs)")
    sweep.add_argument("--kubernetes", metavar="FILE", help="write the Indexed Job manifest to FILE, run nothing")
    sweep.add_argument("--ray", metavar="ADDRESS", help="measure each run on every host kind of the Ray cluster at "
                       "ADDRESS (host:port), each cell on a node of its kind (`ray:` in the file sets it too)")
    sweep.add_argument("--kuberay", metavar="FILE", help="write KubeRay manifests to FILE (a RayCluster with a "
                       "worker group per host kind, a RayJob running the sweep on it), run nothing")
    sweep.add_argument("--quiet", action="store_true", help="only the line per run")
    sweep.set_defaults(func=_sweep)
    node = sub.add_parser("node", help="a Ray node that advertises its host kind, for `workbench sweep --ray`")
    node_sub = node.add_subparsers(dest="action", required=True)
    start = node_sub.add_parser("start", help="`ray start --block` advertising this host's kind (runs until stopped)")
    start.add_argument("--head", action="store_true", help="start the cluster (its GCS on --port)")
    start.add_argument("--address", metavar="HOST:PORT", help="join the cluster whose head is there")
    start.add_argument("--port", type=_port, default=6379, help="the head's GCS port (default 6379)")
    start.add_argument("--kind", help="advertise this host kind instead of the one this CPU's flags make "
                       "(docs/compare.md lists them)")
    start.add_argument("--num-cpus", type=int, help="CPUs Ray may schedule here (default: all)")
    start.add_argument("--ip", help="this node's address as the other nodes reach it (default: Ray's choice; Ray "
                       "does not keep to 127.0.0.1 on Linux: docs/compare.md on token authentication)")
    start.add_argument("--object-store-mb", type=int, help="Ray's object store here, in MiB (default Ray's: 30%% of "
                       "memory); a cell's run folder passes through it")
    start.add_argument("--temp-dir", help="the head's Ray session folder (default Ray's /tmp/ray)")
    start.add_argument("--dry-run", action="store_true", help="print the `ray start` command line, start nothing")
    start.set_defaults(func=_node)
    compared = sub.add_parser("compare", help="runs side by side: one HTML page, a CSV and a JSON table, and the "
                              "(model, variant) to deploy per goal and host")
    compared.add_argument("runs", nargs="+", help="run folders, or folders of runs (a sweep's output root)")
    compared.add_argument("--output", help="folder for compare.html/.csv/.json (default: compare/ in the outputs "
                                           "folder, $WORKBENCH_OUTPUTS or ./outputs)")
    compared.add_argument("--overwrite", action="store_true", help="replace compare files already there")
    compared.add_argument("--min-cosine", type=float, default=0.999,
                          help="the accuracy goal's floor: min cosine (or label agreement) at least this")
    compared.set_defaults(func=_compare)
    lab = sub.add_parser("lab", help="JupyterLab rooted at the outputs folder: working copies of the step notebooks "
                         "in lab/ (the tracked ones stay the templates `workbench run` executes), the runs beside them")
    lab.set_defaults(func=_lab, jupyter_args=[])  # the options it does not know go to jupyter lab (--no-browser, ...)
    serve = sub.add_parser("serve", help="serve a run's model repository on tritonserver until Ctrl-C, SIGTERM or "
                           "SIGHUP; prints its URLs, a curl request and a perf_analyzer command")
    _serve_args(serve)
    serve.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "lab":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.jupyter_args = unknown
    try:
        return args.func(args)
    except RunInterruptedError as exc:
        print(f"stopped ({type(exc).__name__}): {exc}", file=sys.stderr)
        return 128 + exc.signum
    except WorkbenchError as exc:
        print(f"error ({type(exc).__name__}): {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
