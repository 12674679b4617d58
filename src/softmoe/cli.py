"""The ``softmoe`` command: train, evaluate and calibrate classifiers, plus the commands other packages add.

A package adds commands through the entry-point group ``softmoe.commands``: each entry is a function that takes the
argparse subparsers, adds its command and sets its ``handler`` (a function of the parsed arguments). The paper
reproduction of this repository (``softmoe_repro``) adds ``reproduce`` and ``report`` that way; the library itself
never imports it.

Every user mistake (bad option, missing or corrupt data or checkpoint, impossible k, a run folder of another
configuration) and every operating-system error (a read-only folder, a full disk, a path under a file) ends as one
line on stderr naming the problem and exit code 2, with nothing half-written left behind.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import entry_points
from pathlib import Path

COMMANDS = "softmoe.commands"
MNIST_MODEL_NAMES = ("authors", "authors-scale10", "definition1")
"""The keys of :data:`softmoe.models.mnist.MNIST_MODELS`, named here so that parsing imports no torch."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _k_value(text: str) -> int | float:
    """An int k, or a fraction of n written with a decimal point (0.25)."""
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"k must be an integer or a fraction like 0.25, got {text!r}") from None


def _add_bounds(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--k-min", type=positive_int, default=1, help="adaptive strategies: fewest experts (default 1)")
    parser.add_argument("--k-max", type=positive_int, help="adaptive strategies: most experts (default: n)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="softmoe",
        description="Soft Mixture of Experts: train and evaluate models, reproduce 'Beyond Parameter Count'.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train", help="train one Soft MoE classifier (resumes if RUN_DIR has epochs)")
    train.add_argument("run_dir", type=Path, help="folder for checkpoints (safetensors + JSON per epoch)")
    train.add_argument("--dataset", default="mnist5k", help="dataset spec, as for reproduce (default: mnist5k)")
    train.add_argument("--experts", type=positive_int, default=16, help="number of experts n (default: 16)")
    train.add_argument(
        "--model", default="authors", choices=MNIST_MODEL_NAMES, help="the MNIST model (default: authors)"
    )
    train.add_argument("--epochs", type=positive_int, default=15, help="epochs (default: 15)")
    train.add_argument("--batch-size", type=positive_int, default=256, help="batch size (default: 256)")
    train.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default: 1e-3)")
    train.add_argument("--seed", type=int, default=0, help="seed of initialization and shuffling (default: 0)")
    train.add_argument("--no-progress", action="store_true", help="hide progress bars")
    train.add_argument(
        "--resume-last-good",
        action="store_true",
        help="if the run's last checkpoint is damaged, remove that epoch and continue from the one before",
    )
    train.add_argument(
        "--expert-parallel",
        action="store_true",
        help="under torchrun: shard each Soft MoE layer's experts across the ranks (experts divisible by ranks)",
    )
    train.set_defaults(handler=_train)

    evaluate = commands.add_parser("evaluate", help="test accuracy of a trained classifier with k of n experts")
    evaluate.add_argument(
        "run_dir",
        type=Path,
        help="a run folder of 'softmoe train', or one model's folder of the MNIST suite (runs/<model>_<protocol>/nNNN)",
    )
    evaluate.add_argument("--epoch", type=positive_int, help="epoch to load (default: the last)")
    evaluate.add_argument("--k", type=_k_value, help="experts per input: an int, or a fraction of n like 0.25")
    evaluate.add_argument(
        "--strategy",
        choices=("combine", "mass", "budget", "random", "all"),
        help="combine = Algorithm 1 (the default with --k); mass (needs --tau) and budget (--k on average) adapt "
        "the count per input; all (the default without --k): every expert",
    )
    evaluate.add_argument("--tau", type=float, help="the mass strategy's share of the combine mass, in (0, 1]")
    _add_bounds(evaluate)
    evaluate.add_argument("--seeds", type=positive_int, default=10, help="seeds for the random strategy (default: 10)")
    evaluate.add_argument("--renormalize", action="store_true", help="rescale combine weights over the kept slots")
    evaluate.set_defaults(handler=_evaluate)

    calibrate = commands.add_parser(
        "calibrate", help="the cheapest expert selection within an accuracy drop, found on the validation split"
    )
    calibrate.add_argument("run_dir", type=Path, help="a run folder, as for evaluate")
    calibrate.add_argument("--epoch", type=positive_int, help="epoch to load (default: the last)")
    target = calibrate.add_mutually_exclusive_group(required=True)
    target.add_argument("--max-drop", type=float, help="tolerated validation-accuracy drop, in points (e.g. 1.0)")
    target.add_argument("--target", type=float, help="or an absolute validation accuracy to reach (e.g. 0.85)")
    calibrate.add_argument(
        "--strategy",
        choices=("combine", "mass"),
        default="combine",
        help="combine: Algorithm 1 over k = 1..n; mass: the adaptive strategy over a grid of tau (default: combine)",
    )
    calibrate.add_argument("--grid", type=_k_value, nargs="+", help="the k (or tau) values to try")
    _add_bounds(calibrate)
    calibrate.set_defaults(handler=_calibrate)
    for entry in sorted(entry_points(group=COMMANDS), key=lambda entry: entry.name):
        entry.load()(commands)

    return parser


def _train(args: argparse.Namespace) -> None:
    from softmoe.data import load_dataset, portable_spec
    from softmoe.distributed import setup_distributed
    from softmoe.train import TrainConfig, train_classifier

    dist = setup_distributed(expert_parallel=args.expert_parallel)  # single process without torchrun
    try:
        spec = portable_spec(args.dataset)
        splits = load_dataset(spec)
        model_config = {
            "dataset": spec,
            "image_shape": list(splits.train.image_shape),
            "num_experts": args.experts,
            "num_classes": splits.train.num_classes,
            "model": args.model,
        }
        config = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
        _, history = train_classifier(
            lambda: _classifier(model_config),
            splits,
            config,
            args.run_dir,
            progress=not args.no_progress,
            description=f"n={args.experts}",
            dist=dist,
            model_config=model_config,
            resume_last_good=args.resume_last_good,
        )
        if dist.is_main:
            print(json.dumps(history[-1]))
    finally:
        dist.close()


def _classifier(config: dict):
    """The classifier a run folder's model description builds."""
    from softmoe.models import SoftMoEClassifier

    grid = tuple(config.get("grid", (2, 2)))
    return SoftMoEClassifier(
        tuple(config["image_shape"]), config["num_experts"], config["num_classes"], grid, config["model"]
    )


def _run_model(run_dir: Path) -> dict:
    """The model description in a run folder's run.json, or a ValueError saying what the folder is not."""
    from softmoe.checkpoint import read_json
    from softmoe.runs import RUN_FILE

    path = run_dir / RUN_FILE
    if not path.is_file():
        raise FileNotFoundError(
            2, f"no {RUN_FILE}: not a run folder of 'softmoe train' or of the MNIST suite", str(path)
        )
    model = read_json(path).get("model", {})
    needed = ("dataset", "image_shape", "num_experts", "num_classes", "model")
    if not isinstance(model, dict) or any(key not in model for key in needed):
        raise ValueError(f"{path} does not describe a Soft MoE classifier (needs {', '.join(needed)})")
    return model


def _trained(args: argparse.Namespace):
    """(epoch, splits, model in eval mode) of the run folder ``args.run_dir`` at ``args.epoch`` (default: the last)."""
    from softmoe.data import load_dataset
    from softmoe.runs import finished_epochs, load_epoch

    config = _run_model(args.run_dir)
    done = len(finished_epochs(args.run_dir))
    epoch = args.epoch or done
    if not 1 <= epoch <= done:
        raise ValueError(f"epoch {epoch} is not available in {args.run_dir} (finished epochs: 1..{done})")
    limit = config.get("limit_examples")
    splits = load_dataset(config["dataset"]).limit(val=limit, test=limit)
    model = _classifier(config)
    return epoch, splits, load_epoch(model, args.run_dir, epoch).eval()


def _evaluate(args: argparse.Namespace) -> None:
    from softmoe.calibration import evaluate_setting
    from softmoe.selection import random_statistics, select_experts
    from softmoe.train import accuracy

    epoch, splits, model = _trained(args)
    strategy = args.strategy or ("all" if args.k is None else "combine")
    if strategy in ("combine", "budget", "random") and args.k is None:
        raise ValueError(f"--strategy {strategy} needs --k")
    if strategy == "mass" and args.tau is None:
        raise ValueError("--strategy mass needs --tau")
    value = args.tau if strategy == "mass" else args.k
    result = {"epoch": epoch, "all_experts": accuracy(model, splits.test), "strategy": strategy, "k": args.k}
    if strategy == "random":
        accuracies = []
        for seed in range(args.seeds):
            with select_experts(model, k=args.k, strategy=strategy, renormalize=args.renormalize, seed=seed):
                accuracies.append(accuracy(model, splits.test))
        result["random"] = random_statistics(accuracies)
    elif strategy != "all":
        setting = evaluate_setting(
            model, splits.test, strategy, value, k_min=args.k_min, k_max=args.k_max, renormalize=args.renormalize
        )
        result.update(tau=args.tau, accuracy=setting.accuracy, expert_fraction=setting.expert_fraction)
    print(json.dumps(result, indent=2))


def _calibrate(args: argparse.Namespace) -> None:
    import warnings

    from softmoe.calibration import calibrate
    from softmoe.selection import NoBetterThanRandomWarning

    epoch, splits, model = _trained(args)
    if _run_model(args.run_dir).get("train_split") == "train+val":
        _note(
            args,
            "this model was trained on the validation split too (the authors' protocol trains on the whole "
            "training set), so the validation accuracies are on training images; the test accuracies are not",
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NoBetterThanRandomWarning)
        result = calibrate(
            model,
            splits.val,
            args.max_drop,
            target=args.target,
            strategy=args.strategy,
            grid=args.grid,
            test=splits.test,
            k_min=args.k_min,
            k_max=args.k_max,
        )
    for warning in caught:
        if issubclass(warning.category, NoBetterThanRandomWarning):
            _note(args, str(warning.message))
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    print(json.dumps({"epoch": epoch, **result.to_json()}, indent=2))


def _note(args: argparse.Namespace, text: str) -> None:
    """One line on stderr that the user should read, beside the command's output."""
    print(f"softmoe {args.command}: note: {text}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from softmoe.data import DatasetError, MissingDependencyError
    from softmoe.runtime import tune_cpu_allocator

    tune_cpu_allocator()
    try:
        args.handler(args)
    except (ValueError, DatasetError, MissingDependencyError) as error:
        print(f"softmoe {args.command}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a missing file, a read-only folder, a full disk, a path under a file, ...
        where = error.filename or ""
        reason = error.strerror or str(error)
        print(
            f"softmoe {args.command}: error: {where}: {reason}"
            if where
            else f"softmoe {args.command}: error: {reason}",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("softmoe: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
