"""``dsv4-parity bench``: the command-line half of :mod:`bench.core` (speed and memory, reported, never asserted).
The parser needs only :mod:`bench.vocabulary`; :func:`cmd_bench` imports the bench (and torch) when it runs."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

from bench.vocabulary import LAYOUTS, LOSSES, OPT_IN_SECTIONS, SECTIONS
from cli.options import PROVIDERS, add_megatron_argument
from parity.names import OUT_ROOT

DESCRIPTION = """\
Performance of the fused path (or any --impl, e.g. production), the reference and the harness: reported, never
asserted.

Sections: e2e, stages, breakdown, scaling, harness, startup, gate (see the module docstring of bench/core.py for
what each measures)."""


def default_json_path() -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return OUT_ROOT / "bench" / f"bench-{stamp}.json"


def cmd_bench(args: argparse.Namespace) -> int:
    from bench.core import resolve_settings, run_bench
    from bench.output import render_tables, write_plot
    from bench.side_by_side import markdown

    settings = resolve_settings(args)  # a bad option: CaseError, one line and exit 2 (cli.main)

    def log(msg: str) -> None:
        if not settings.quiet:
            print(f"bench: {msg}", file=sys.stderr, flush=True)

    path = Path(args.json) if args.json else default_json_path()
    path.parent.mkdir(parents=True, exist_ok=True)

    md = path.with_suffix(".md")
    md.unlink(missing_ok=True)  # an earlier run's table must not pass for this one's

    def save(doc: dict) -> None:
        """The JSON (and the side-by-side markdown), rewritten whole after every e2e row and every section."""
        for target, text in ((path, json.dumps(doc, indent=1) + "\n"),
                             (md, markdown(doc["side_by_side"], settings.impls,
                                           doc["env"].get("gpu") or doc["machine"].get("processor") or "")
                              if doc.get("side_by_side") else None)):
            if text is not None:
                tmp = target.with_suffix(target.suffix + ".tmp")
                tmp.write_text(text)
                tmp.replace(target)

    report = run_bench(settings, ["dsv4-parity", *getattr(args, "argv", sys.argv[1:])], log, checkpoint=save)
    save(report)
    png = None if args.no_plot else write_plot(report, Path(args.plot) if args.plot else path.with_suffix(".png"))
    render_tables(report)
    print(f"json: {path}" + (f"\nplot: {png}" if png else "") + (f"\nmarkdown: {md}" if md.exists() else ""))
    return 0


BENCH_EPILOG = """\
examples:
  dsv4-parity bench                                   # CPU: tiny profile, T = 256..2048, ~20 s
  dsv4-parity bench --json out/bench.json             # + out/bench.png
  dsv4-parity bench --profile kernel,flash,pro --tokens 4K,8K,16K,32K,64K --json $OUT/bench.json   # one H200
  dsv4-parity bench --sections harness --harness-suite smoke --harness-limit 0   # the whole smoke suite
  dsv4-parity bench --sections gate --json $OUT/gate.json   # one H200: the gate suite cold, then warm; its wall
                                                      # time over the summed time of the kernels it checks
  dsv4-parity bench --sections ops --harness-suite smoke --harness-limit 0 --json out/ops.json
                                                      # ATen ops (~ kernel launches) per case and phase, any device
  dsv4-parity bench --sections e2e --impl megatron --provider emulated --profile tiny --tokens 256 --no-reference
                                                      # CPU: production's fused path over the torch stand-ins
  dsv4-parity bench --sections e2e --impl fused,megatron --profile kernel,pro --tokens 4K,16K,32K \\
      --scope layer,core --provider cudnn --no-reference --budget-s 180 --json $OUT/bench-megatron.json --no-plot
                                                      # one H200: production beside fused, each vs its kernel sum

--impl a,b measures each implementation's forward + backward in the e2e section (the reference beside them unless
--no-reference) and, where it offers an observe_kernels hook (fused, megatron), the sum of its kernel calls and the
ratio; the side-by-side table is also written as markdown next to the JSON (<json>.md). --provider maps per
implementation: fused takes it as is (auto: the best per stage); megatron: cudnn = the real kernels, emulated /
unfused as named, auto = cudnn where its kernels run, else unfused; or name one per implementation
(--provider fused=torch,megatron=emulated). A provider an implementation lacks or cannot run here makes its rows
unsupported (with the reason); megatron's unfused provider runs no kernel call (kernel sum none, the row's
kernels_note says so).

Numbers are reported, never asserted (exit 0 unless the options are wrong). Everything that does not fit the
--budget-s deadline, exceeds --ref-max-tokens or runs out of memory is listed as skipped / oom in the JSON.
"""


def add_parsers(subparsers: argparse._SubParsersAction) -> dict:
    """Register ``bench`` on the ``dsv4-parity`` subparsers."""
    p = subparsers.add_parser(
        "bench", help="benchmark the fused path (or --impl), the reference and the harness (reported, never asserted)",
        description=DESCRIPTION, epilog=BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", help="profiles, comma-separated (CPU default tiny; CUDA kernel,flash,pro)")
    p.add_argument("--tokens", help="token counts T, comma-separated, 4K suffixes allowed (CPU default "
                                    "256,512,1024,2048; CUDA 4K,8K,16K,32K,64K)")
    p.add_argument("--layout", default="seq", choices=LAYOUTS,
                   help="seq: one sequence of T tokens (BSHD); pack: THD pack of --segment-len segments")
    p.add_argument("--segment-len", type=int, help="segment length of THD packs (CPU 256, CUDA 4096)")
    p.add_argument("--ratio", type=int, default=4, help="compress ratio of the benchmarked layer (default 4)")
    p.add_argument("--loss", default="sparse", choices=LOSSES, help="indexer loss (default sparse)")
    p.add_argument("--dtype", help="activation dtype (CPU default float32, CUDA bfloat16)")
    p.add_argument("--scope", help="core and/or layer, comma-separated (default core,layer)")
    p.add_argument("--sections", help=f"comma-separated subset of {','.join(SECTIONS + OPT_IN_SECTIONS)} (default all but "
                                       f"{','.join(OPT_IN_SECTIONS)})")
    p.add_argument("--impl", default="fused",
                   help="implementations measured in e2e, comma-separated: fused, megatron or module[:attr] "
                        "(default fused); the reference runs beside them")
    p.add_argument("--no-reference", action="store_true",
                   help="e2e without the reference (and no 32K Pro-pack probe of it)")
    p.add_argument("--provider", default="auto",
                   help=f"kernel provider (default auto), one of {','.join(PROVIDERS)} for every implementation or "
                        "per implementation (fused=torch,megatron=emulated): fused's auto/torch/cudnn/flashmla; "
                        "megatron's unfused/emulated/cudnn, auto = cudnn where its kernels run, else unfused")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    add_megatron_argument(p)
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs per measurement (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats, at most (default 3)")
    p.add_argument("--target-s", type=float, default=1.0,
                   help="seconds of timed repeats per measurement; fewer repeats when one run is slower")
    p.add_argument("--budget-s", type=float, help="deadline for the whole bench in seconds (CPU 55, CUDA 300; 0 = none)")
    p.add_argument("--ref-max-tokens", type=int,
                   help="skip reference runs above this T (CUDA default 32768; 0 = no limit)")
    p.add_argument("--harness-suite", help="suite for the harness and ops sections (CPU smoke, CUDA gate)")
    p.add_argument("--harness-limit", type=int,
                   help="cases of it, spread over the suite (CPU 0 = all, CUDA 24)")
    p.add_argument("--no-harness-report", action="store_true", help="do not time the report rendering")
    p.add_argument("--peak-tflops", type=float, help="peak for the %% column (CUDA default 790, the H200 bf16)")
    p.add_argument("--threads", type=int,
                   help="torch intra-op threads (CPU default 1: on a shared machine two threads make the timings "
                        "bimodal; CUDA default: unchanged)")
    p.add_argument("--startup-repeats", type=int, default=5,
                   help="fresh processes per command in the startup section (default 5; the median is reported)")
    p.add_argument("--gate-suite", default="gate", help="suite of the gate section (default gate)")
    p.add_argument("--gate-impl", default="fused",
                   help="--impl of the gate runs (default fused; megatron: the production gate, target "
                        "production_gate_warm_s)")
    p.add_argument("--gate-provider", default="cudnn", help="--provider of the gate runs (default cudnn)")
    p.add_argument("--gate-workers", default="auto", help="--workers of the gate runs (default auto)")
    p.add_argument("--gate-limit", type=int, help="--limit of the gate runs (default: the whole suite)")
    p.add_argument("--gate-runs", help="cold and/or warm, in order (default cold,warm; cold empties the cache); a label named again is a "
                        "repeat (warm,warm: written to warm and warm-2) and the section reports the spread of their wall times")
    p.add_argument("--gate-cache-dir", help="compiled-kernel cache of the gate runs (default <gate dir>/kernel-cache)")
    p.add_argument("--gate-budget-s", type=float,
                   help="deadline of the gate section in seconds (default none): runs that cannot start are skipped, "
                        "a running one is cut")
    p.add_argument("--gate-dir", help="where the gate runs write (default reports/out/bench/gate-<time>)")
    p.add_argument("--json", metavar="PATH", help="write the JSON here (default reports/out/bench/bench-<time>.json)")
    p.add_argument("--plot", metavar="PATH", help="write the PNG here (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true", help="no PNG")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_bench)
    return {"bench": p}
