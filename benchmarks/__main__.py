"""The benchmark suite: `python -m benchmarks [--quick [--smoke]] [--out DIR] [--docs]`.

Runs every engine scenario for the asyncio baseline and for wmo_trio under each host (each
in its own interpreter, since trio-asyncio changes asyncio's loop policy process-wide), real
model traffic through the real SDK (`benchmarks/traffic.py`), the real harbor job, the
docker-free environment's start/stop cost, what the sandbox backend adds to an episode
over `local` (`benchmarks/sandbox_backend.py`), and the scale-out on Ray: the research API
on worker processes against one process and the SDK alone, a harbor job with `--workers`
against one process (`benchmarks/scale_out.py`). Writes `results.json`,
`results.md` (each figure for the baseline and every wmo_trio host, with the ratio) and
PNG plots of start and cancellation latency against the number of concurrent episodes.
All figures come from this one run on this machine: compare ratios, not absolute values.
`--docs` puts the tables and plots into docs/benchmarks.md and the headline rows into the
README.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks import traffic
from benchmarks.forked import Forked

ROOT = Path(__file__).resolve().parent.parent
ENGINE_IMPLS = ("baseline", "thread", "guest", "trio-asyncio")
WMO_HOSTS = ("thread", "guest", "trio-asyncio")


def machine() -> str:
    cpus = os.cpu_count()
    memory = ""
    try:
        with open("/proc/meminfo") as meminfo:
            memory = f", {int(meminfo.readline().split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    return (f"{platform.system()} {platform.machine()}, {cpus} cores{memory}, "
            f"Python {platform.python_version()}")


def run_engines(quick: bool) -> dict[str, dict[str, Any]]:
    """Every implementation in its own interpreter: one after the other in a full run, so
    they never share the machine; side by side in a quick run, which checks shape only."""
    def start(impl: str) -> subprocess.Popen[str]:
        command = [sys.executable, "-W", "ignore", "-m", "benchmarks.engine", "--impl", impl]
        if quick:
            command.append("--quick")
        return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})

    def finish(impl: str, process: subprocess.Popen[str]) -> dict[str, Any]:
        out, err = process.communicate(timeout=3600)
        if process.returncode != 0:
            raise RuntimeError(f"engine benchmark {impl} failed:\n{err[-3000:]}")
        result: dict[str, Any] = json.loads(out)
        return result

    if quick:
        running = {impl: start(impl) for impl in ENGINE_IMPLS}
        return {impl: finish(impl, process) for impl, process in running.items()}
    results = {}
    for impl in ENGINE_IMPLS:
        print(f"engine scenarios: {impl} ...", file=sys.stderr, flush=True)
        results[impl] = finish(impl, start(impl))
    return results


def fork_engines() -> dict[str, Forked]:
    """A smoke run's engine scenarios: every implementation in a forked copy of this
    process, side by side, started before this process runs any thread of its own; each
    copy has imported the engine already, which a fresh interpreter would do again."""
    from benchmarks import engine  # noqa: F401 - for the copies

    return {impl: Forked(f"engine benchmark {impl}", _smoke_engine, impl) for impl in ENGINE_IMPLS}


def _smoke_engine(impl: str) -> dict[str, Any]:
    from benchmarks import engine

    warnings.simplefilter("ignore")  # as `-W ignore` keeps a quick run's engines quiet
    return engine.measure(impl, True, smoke=True)


def fork_harbor_job() -> Forked:
    """A smoke run's real harbor job: its three jobs through their CLIs in a forked copy of
    this process, which imports harbor anyway (`harbor_job.run`)."""
    from benchmarks import harbor_job

    harbor_job.import_clis()
    return Forked("real harbor job", harbor_job.run, True, True)


def _fmt(value: float, unit: str) -> str:
    if value != value:  # NaN
        return "-"
    if unit in ("ms", "us"):
        return f"{value:,.1f} {unit}" if value < 100 else f"{value:,.0f} {unit}"
    if unit == "x":
        return f"{value:.3f}x"
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "cores":
        return f"{value:.2f}"
    return f"{value:,.0f}{unit}"


def _ratio(value: float, base: float) -> str:
    if value != value or base != base or base == 0:
        return "-"
    return f"{value / base:.2f}"


def engine_rows(engine: dict[str, dict[str, Any]]) -> list[tuple[str, str, dict[str, float]]]:
    """(metric, unit, {impl: value}) for every engine figure."""
    rows: list[tuple[str, str, dict[str, float]]] = []
    sizes = [s["n"] for s in engine["baseline"]["start"]]
    for index, n in enumerate(sizes):
        for key, label, unit in (("setup_ms", "setup before the burst (thread warm-up)", "ms"),
                                 ("start_p50_ms", "start latency p50", "ms"),
                                 ("start_p99_ms", "start latency p99", "ms"),
                                 ("batch_start_p99_ms", "first step p99, from the batch start",
                                  "ms"),
                                 ("wall_over_ideal", "wall time / ideal", "x"),
                                 ("cpu_over_ideal", "process CPU time / ideal wall time", "x"),
                                 ("heartbeat_p99_ms", "host heartbeat lateness p99", "ms"),
                                 ("peak_threads", "peak threads", ""),
                                 ("peak_rss_mb", "peak RSS (MiB)", "")):
            rows.append((f"{label} @ {n}", unit,
                         {impl: r["start"][index][key] for impl, r in engine.items()}))
    rows.append((f"per-episode overhead ({engine['baseline']['overhead']['episodes']:,} tiny "
                 "episodes)", "us", {i: r["overhead"]["per_episode_us"] for i, r in engine.items()}))
    rows.append(("tool-call round trip worker -> loop -> worker", "us",
                 {i: r["round_trip"]["per_call_us"] for i, r in engine.items()}))
    rows.append(("same round trip, bare thread -> loop, no wmo_trio (the loop's own floor)", "us",
                 {i: r["round_trip"]["bare_loop_per_call_us"] for i, r in engine.items()}))
    for index, case in enumerate(engine["baseline"]["cancel"]):
        what = f"{case['in_flight_s']:g} s {case['during']} in flight, {case['n']} episodes"
        for key, label in (("cancel_p50_ms", "cancel p50"), ("cancel_p99_ms", "cancel p99")):
            rows.append((f"{label}, {what}", "ms",
                         {i: r["cancel"][index][key] for i, r in engine.items()}))
        rows.append((f"traces on disk, {what}", "",
                     {i: r["cancel"][index]["traces"] for i, r in engine.items()}))
    bridge = engine["baseline"]["cancel_bridge_only"]
    for key, label in (("cancel_p50_ms", "cancel p50"), ("cancel_p99_ms", "cancel p99")):
        rows.append((f"{label}, nothing in flight and no trace (the bridge alone), {bridge['n']} "
                     "episodes", "ms", {i: r["cancel_bridge_only"][key] for i, r in engine.items()}))
    rows.append(("threads left after idle timeout", "",
                 {i: r["threads_left_after_idle"] for i, r in engine.items()}))
    return rows


def _table(first: str, base_label: str, columns: dict[str, str],
           rows: list[tuple[str, str, dict[str, float]]]) -> list[str]:
    """A markdown table: the baseline, then each column with its ratio to the baseline."""
    lines = [
        f"| {first} | {base_label} | " + " | ".join(columns.values())
        + " | ratio " + " / ".join(columns) + " |",
        "|---|---:|" + "---:|" * len(columns) + "---:|",
    ]
    for metric, unit, values in rows:
        base = values["baseline"]
        lines.append(
            f"| {metric} | {_fmt(base, unit)} | "
            + " | ".join(_fmt(values[c], unit) for c in columns)
            + " | " + " / ".join(_ratio(values[c], base) for c in columns) + " |")
    return lines


def traffic_markdown(result: dict[str, Any]) -> list[str]:
    profile, sdk = result["profile"], result["sdk"]
    before, after = result["load_before"], result["load_after"]
    names = {"research": "research API (trio)", "sdk-alone": "SDK alone (trio, no wmo_trio)"}
    columns = {impl: names.get(impl, f"wmo_trio {impl}")
               for impl in result["impls"] if impl != "baseline"}
    lines = [
        "",
        f"Real model traffic: every episode makes {profile['tool_calls']} bash calls, then "
        f"submits; each model call is answered after {profile['model_s']:g} s (the real "
        "`anthropic` SDK against the benchmark's loopback Messages API server, in a process of "
        "its own; the `openai` rows, the real `openai` SDK against the same server's Chat "
        f"Completions endpoint), each command takes {profile['command_s']:g} s: "
        f"{result['ideal_s']:g} s ideal. A step is one model call with its tool call. The "
        "SDKs' own cost here, a bare loop of calls to the same server: "
        f"{sdk['sync_cpu_per_call_ms']:.2f} ms of CPU per call with Anthropic's sync client, "
        f"{sdk['async_trio_cpu_per_call_ms']:.2f} ms with `AsyncAnthropic` on trio "
        f"(a client costs {sdk['client_cpu_ms']:.0f} ms to construct); "
        f"{sdk['openai_sync_cpu_per_call_ms']:.2f} ms with OpenAI's sync client, "
        f"{sdk['openai_async_trio_cpu_per_call_ms']:.2f} ms with `AsyncOpenAI` on trio. "
        "The original design has no OpenAI agent: no baseline in those rows. "
        "Heartbeat lateness counts from the moment every episode has run its first command; "
        "\"start included\" counts from the launch. The baseline is the original's design (the "
        "sync SDK called in its executor's threads); `research` is `open_episode_pool` + "
        f"`fan_out`. Each trial's `run()` times out after {result['cap_s']:g} s (harbor's agent "
        "timeout; for the research API, its whole fan-out). Load average (1 min) "
        f"{before[0]:.2f} before, {after[0]:.2f} after; the last rows say how many cores the "
        "machine's other processes used during each run.",
        "",
    ]
    lines += _table("real traffic", "baseline (original design)", columns,
                    traffic.markdown_rows(result))
    split = traffic.split_rows(result)
    if split:
        lines += ["", "Beyond one process: the same episodes (anthropic) in one interpreter, and "
                  "split over one interpreter per core started side by side.", "",
                  "| implementation | processes x episodes | wall / ideal (slowest process) "
                  "| process CPU per step (mean) | submitted |", "|---|---|---:|---:|---:|"]
        lines += [f"| {names.get(impl, f'wmo_trio {impl}')} | {layout} | {_fmt(wall, 'x')} | "
                  f"{_fmt(cpu, 'ms')} | {submitted:,} |" for impl, layout, wall, cpu, submitted in split]
    for failure in traffic.failures(result):
        lines.append(f"\nNo figures for {failure}")
    return lines


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Measured {results['date']} on {results['machine']} ({results['mode']} run). "
        "Ratios are wmo_trio over the baseline from the same run; the machine is shared, so "
        "absolute figures move between runs.",
    ]
    engine = results.get("engine")
    if engine:
        lines.append("")
        lines += _table("scenario", "baseline (asyncio)",
                        {h: f"wmo_trio {h}" for h in WMO_HOSTS}, engine_rows(engine))
    if results.get("traffic"):
        lines += traffic_markdown(results["traffic"])
    job = results.get("harbor_job")
    if job:
        lines += [
            "",
            f"Real harbor job: {job['n']} trials of `hello-file` at `-n {job['n']}`, docker-free "
            f"environment, {job['latency_s']:g} s per model call"
            + (" (smoke run: the three jobs through their CLIs in one process, one after the "
               "other)." if job.get("in_process")
               else " (quick run: the three jobs side by side, each row its own job's wall time "
               "from their common start)." if job.get("side_by_side") else "."),
            "",
            "| agent / host | wall | mean agent phase | agent overhead per trial | mean reward |",
            "|---|---:|---:|---:|---:|",
        ]
        for key, label in (("baseline", "baseline agent, harbor CLI"),
                           ("wmo_trio", "wmo_trio, harbor CLI (thread host)"),
                           ("wmo_trio_trio_host", "wmo_trio, `wmo-trio run` (trio host)")):
            row = job[key]
            ratio = _ratio(row["wall_s"], job["baseline"]["wall_s"])
            lines.append(f"| {label} | {row['wall_s']:.2f} s ({ratio}) | {row['agent_mean_s']:.3f} s "
                         f"| {row['agent_overhead_ms']:.0f} ms | {row['mean_reward']:.2f} |")
    local = results.get("local_environment")
    if local:
        lines += ["", "Docker-free environment: " + ", ".join(
            f"{k.replace('_', ' ')} {v:.3g}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}"
            for k, v in local.items() if isinstance(v, int | float)) + "."]
    sandboxed = results.get("sandbox_backend")
    if sandboxed:
        start = sandboxed["details"]["start"]
        burst = sandboxed["details"]["burst"]
        lines += [
            "",
            f"Sandbox backend against `local` in the same run: {start['n']} sequential "
            f"`code:runtime` episodes, then {burst['n']} at once (two {burst['latency_s']:g} s "
            "model calls each).",
            "",
            "| figure | local | sandbox, pool | sandbox, no pool |",
            "|---|---:|---:|---:|",
            f"| start to first model call, median | {start['local']['start']['median_ms']:.1f} ms "
            f"| {start['sandbox_pool']['start']['median_ms']:.1f} ms "
            f"| {start['sandbox_cold']['start']['median_ms']:.1f} ms |",
            f"| added start latency, median | - | {start['added_start_median_ms']['sandbox_pool']:.1f}"
            f" ms | {start['added_start_median_ms']['sandbox_cold']:.1f} ms |",
            f"| whole episode, median | {start['local']['episode']['median_ms']:.1f} ms "
            f"| {start['sandbox_pool']['episode']['median_ms']:.1f} ms "
            f"| {start['sandbox_cold']['episode']['median_ms']:.1f} ms |",
            f"| {burst['n']} at once: wall / ideal | {burst['local']['wall_over_ideal']:.2f} "
            f"| {burst['sandbox']['wall_over_ideal']:.2f} "
            f"({_ratio(burst['sandbox']['wall_s'], burst['local']['wall_s'])}) | - |",
            f"| {burst['n']} at once: first model call p50 / p99 | "
            f"{burst['local']['first_call_p50_ms']:.0f} / {burst['local']['first_call_p99_ms']:.0f} ms "
            f"| {burst['sandbox']['first_call_p50_ms']:.0f} / {burst['sandbox']['first_call_p99_ms']:.0f}"
            " ms | - |",
            f"| {burst['n']} at once: submitted | {burst['local']['submitted']} "
            f"| {burst['sandbox']['submitted']} | - |",
        ]
    return "\n".join(lines) + "\n"


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    engine = results.get("engine")
    if not engine:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    figure, axis = plt.subplots(figsize=(6, 4))
    for impl, result in engine.items():
        sizes = [s["n"] for s in result["start"]]
        axis.plot(sizes, [s["start_p99_ms"] for s in result["start"]], marker="o", label=f"{impl} p99")
        axis.plot(sizes, [s["start_p50_ms"] for s in result["start"]], marker=".", linestyle="--",
                  label=f"{impl} p50")
    axis.set(xscale="log", xlabel="concurrent episodes", ylabel="start latency (ms)",
             title="start latency: run() to the worker")
    axis.legend(fontsize=7)
    figure.tight_layout()
    written.append(out / "start_latency.png")
    figure.savefig(written[-1], dpi=120)
    figure, axis = plt.subplots(figsize=(6, 4))
    for impl, result in engine.items():
        for during, marker in (("command", "o"), ("model", "s")):
            cases = sorted((c for c in result.get("cancel_by_n", result["cancel"])
                            if c["during"] == during), key=lambda c: c["n"])
            axis.plot([c["n"] for c in cases], [c["cancel_p99_ms"] for c in cases], marker=marker,
                      label=f"{impl}, {during} in flight")
    axis.set(xscale="log", yscale="log", xlabel="concurrent episodes",
             ylabel="timeout to run() returning, p99 (ms)", title="cancellation latency")
    axis.legend(fontsize=7)
    figure.tight_layout()
    written.append(out / "cancel_latency.png")
    figure.savefig(written[-1], dpi=120)
    plt.close("all")
    return written


DOCS_PAGE = ROOT / "docs" / "benchmarks.md"
PLOTS = ROOT / "docs" / "plots"
README = ROOT / "README.md"
TABLES = ("<!-- bench:start -->", "<!-- bench:end -->")
SUMMARY = ("<!-- bench-summary:start -->", "<!-- bench-summary:end -->")
# The scale-out part has sections of its own: `--only scale-out --docs` rewrites them alone.
SCALE_OUT_TABLES = ("<!-- bench-scale-out:start -->", "<!-- bench-scale-out:end -->")
SCALE_OUT_SUMMARY = ("<!-- bench-scale-out-summary:start -->", "<!-- bench-scale-out-summary:end -->")

# The front page's rows: (part, the full table whose rows it reads, a row label). A label
# that matches one row per size takes the last, the largest size.
HEADLINE = (
    ("engine", "scenario", r"cancel p99, [\d.]+ s command in flight, [\d,]+ episodes"),
    ("engine", "scenario", r"wall time / ideal @ [\d,]+"),
    ("engine", "scenario", r"host heartbeat lateness p99 @ [\d,]+"),
    ("engine", "scenario", r"per-episode overhead \(.*\)"),
    ("engine", "scenario", r"threads left after idle timeout"),
    ("real traffic", "real traffic", r"wall time / ideal @ [\d,]+ \(anthropic\)"),
    ("real traffic", "real traffic", r"process CPU per step @ [\d,]+ \(anthropic\)"),
    ("real traffic", "real traffic",
     r"host asyncio loop heartbeat lateness p99 @ [\d,]+ \(anthropic\)"),
)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _table_rows(text: str, first: str) -> list[list[str]]:
    """The rows of the markdown table in `text` whose header starts with `first`."""
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith(f"| {first} |")), None)
    if header is None:
        return []
    rows = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    return rows


def headline(table: str) -> str:
    """The front page's summary: a few rows of the full tables, the baseline against wmo_trio
    on the thread host (harbor's default), read from the tables as `markdown` wrote them."""
    measured = table.splitlines()[0].split(". ")[0]
    lines = [f"{measured}. The ratio is wmo_trio over the baseline, and lower is better in "
             "every row; the full tables, every host and what each figure says: "
             "[docs/benchmarks.md](docs/benchmarks.md).", "",
             "| part | figure | baseline | wmo_trio (thread host) | ratio |",
             "|---|---|---:|---:|---:|"]
    for part, first, label in HEADLINE:
        found = [row for row in _table_rows(table, first) if re.fullmatch(label, row[0])]
        if found:
            row = found[-1]
            lines.append(f"| {part} | {row[0]} | {row[1]} | {row[2]} | {row[-1].split(' / ')[0]} |")
    job = re.search(r"^Real harbor job: (\d+) trials", table, re.M)
    agents = {row[0]: row for row in _table_rows(table, "agent / host")}
    ours, theirs = agents.get("wmo_trio, harbor CLI (thread host)"), agents.get(
        "baseline agent, harbor CLI")
    if job and ours and theirs:
        lines.append(f"| harbor job | wall time, {job[1]} trials of `hello-file` | "
                     f"{theirs[1].split(' (')[0]} | {ours[1].split(' (')[0]} | "
                     f"{ours[1].split(' (')[1].rstrip(')')} |")
    return "\n".join(lines) + "\n"


def replace_between(path: Path, markers: tuple[str, str], text: str) -> None:
    start, end = markers
    content = path.read_text()
    if start not in content or end not in content:
        raise SystemExit(f"{path.relative_to(ROOT)} has no {start} ... {end} section")
    head, rest = content.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{text}{end}{tail}")


def update_scale_out_docs(result: dict[str, Any]) -> None:
    """The scale-out part's tables into docs/benchmarks.md, its rows into the README."""
    from benchmarks import scale_out

    replace_between(DOCS_PAGE, SCALE_OUT_TABLES, "\n".join(scale_out.markdown(result)) + "\n")
    replace_between(README, SCALE_OUT_SUMMARY, "\n".join(scale_out.headline(result)) + "\n")


def update_docs(table: str, plotted: list[Path]) -> None:
    """The full tables and the plots into docs/benchmarks.md, the headline into the README."""
    PLOTS.mkdir(exist_ok=True)
    figures = []
    for plot in plotted:
        shutil.copyfile(plot, PLOTS / plot.name)
        figures.append(f"![{plot.stem.replace('_', ' ')}](plots/{plot.name})")
    replace_between(DOCS_PAGE, TABLES, table + ("\n" + "\n".join(figures) + "\n" if figures else ""))
    replace_between(README, SUMMARY, headline(table))


# What a run measures, in order; each is saved to partial.json as it ends.
PARTS = ("engine", "traffic", "harbor_job", "local_environment", "sandbox_backend", "scale_out")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("--quick", action="store_true", help="every scenario, small sizes")
    parser.add_argument("--smoke", action="store_true",
                        help="with --quick: every scenario and implementation at the fewest "
                             "episodes that still give each figure (what the test suite runs "
                             "to check the outputs; the figures mean nothing)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results")
    parser.add_argument("--docs", action="store_true",
                        help="put the tables and plots into docs/benchmarks.md, the headline "
                             "rows into README.md (with --only scale-out: that part's alone)")
    parser.add_argument("--skip-harbor", action="store_true", help="no real harbor job")
    parser.add_argument("--resume", action="store_true",
                        help="keep the parts a run that stopped early measured (in --out's "
                             "partial.json, same mode and day) and run only the rest")
    parser.add_argument("--only", choices=("engine", "traffic", "harbor", "sandbox", "scale-out"),
                        help="one part of the suite (not with --docs); scale-out: the research "
                             "API and a harbor job on Ray worker processes against one process")
    args = parser.parse_args()
    if args.only and args.only != "scale-out" and args.docs:
        parser.error("--docs needs every scenario (or --only scale-out, which has sections of "
                     "its own): leave out --only")
    if args.smoke and (args.docs or not args.quick):
        parser.error("--smoke is a smaller --quick run, never for the docs: use it with "
                     "--quick and without --docs")
    parts = {args.only} if args.only else {"engine", "traffic", "harbor", "sandbox", "scale-out"}
    if args.skip_harbor:
        parts.discard("harbor")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "machine": machine(),
        "mode": "smoke" if args.smoke else "quick" if args.quick else "full",
    }
    # Each part is saved as it ends: a full run takes most of an hour, and a failure in
    # its last part must not cost the others.
    partial = args.out / "partial.json"
    if args.resume and partial.is_file():
        kept = json.loads(partial.read_text())
        if (kept.get("date"), kept.get("mode"), kept.get("machine")) == (
                results["date"], results["mode"], results["machine"]):
            results = kept
            print("resuming: " + ", ".join(k for k in PARTS if k in kept), file=sys.stderr)

    def save() -> None:
        partial.write_text(json.dumps(results, indent=2))

    smoke_traffic: traffic.SmokeRunner | None = None

    def run_traffic() -> None:
        results["traffic"] = traffic.suite(
            args.quick, smoke=smoke_traffic,
            log=lambda line: print(f"real traffic: {line}", file=sys.stderr, flush=True))

    # A smoke run's copies are forked before the traffic thread starts: a fork takes one.
    forked_engines: dict[str, Forked] = {}
    if "engine" in parts and "engine" not in results and args.smoke:
        forked_engines = fork_engines()
    forked_job = None
    if "harbor" in parts and "harbor_job" not in results and args.smoke:
        forked_job = fork_harbor_job()
    if "traffic" in parts and "traffic" not in results and args.smoke:
        smoke_traffic = traffic.SmokeRunner()  # the last: no other copy holds its orders' pipe
    background: threading.Thread | None = None
    if "traffic" in parts and args.quick:
        # Shape only: the traffic runs share the machine with the rest of the quick suite,
        # which keeps the whole of it to a couple of minutes.
        background = threading.Thread(target=run_traffic, name="traffic")
        background.start()
    if "engine" in parts and "engine" not in results and not forked_engines:
        results["engine"] = run_engines(args.quick)
        save()
    if "traffic" in parts and background is None and "traffic" not in results:
        run_traffic()
        save()
    if "harbor" in parts:
        from benchmarks import harbor_job, local_environment

        if "harbor_job" not in results and forked_job is None:
            print("real harbor job ...", file=sys.stderr, flush=True)
            results["harbor_job"] = harbor_job.run(args.quick, args.smoke)
            save()
        if "local_environment" not in results:
            print("docker-free environment ...", file=sys.stderr, flush=True)
            results["local_environment"] = local_environment.run(args.quick, args.smoke)
            save()
    if "sandbox" in parts and "sandbox_backend" not in results:
        from benchmarks import sandbox_backend

        print("sandbox backend ...", file=sys.stderr, flush=True)
        results["sandbox_backend"] = sandbox_backend.run(args.quick, args.smoke)
    if "scale-out" in parts and "scale_out" not in results:
        from benchmarks import scale_out

        print("scale-out on Ray ...", file=sys.stderr, flush=True)
        results["scale_out"] = scale_out.run(
            args.quick, args.smoke,
            log=lambda line: print(f"scale-out: {line}", file=sys.stderr, flush=True))
        save()
    if forked_engines:
        results["engine"] = {impl: forked.result(3600) for impl, forked in forked_engines.items()}
        save()
    if forked_job is not None:
        results["harbor_job"] = forked_job.result(3600)
        save()
    if background is not None:
        background.join()
        if "traffic" not in results:
            raise SystemExit("the real-traffic scenario failed (see above)")
    results["seconds"] = time.perf_counter() - started
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    partial.unlink(missing_ok=True)
    table = markdown(results)
    scaled = ""
    if results.get("scale_out"):
        from benchmarks import scale_out

        scaled = "\n" + "\n".join(scale_out.markdown(results["scale_out"])) + "\n"
    (args.out / "results.md").write_text(table + scaled)
    written = plots(results, args.out)
    if args.docs and args.only != "scale-out":
        update_docs(table, written)
    if args.docs and results.get("scale_out"):
        update_scale_out_docs(results["scale_out"])
    print(table + scaled)
    print(f"results in {args.out}: results.json, results.md, "
          + ", ".join(p.name for p in written), file=sys.stderr)


if __name__ == "__main__":
    main()
