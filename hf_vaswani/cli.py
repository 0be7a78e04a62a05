"""The `vaswani` command: thin argument parsing over the library."""

import argparse
import json
import os
import shlex
import sys
import types
import typing
from dataclasses import fields, replace
from pathlib import Path

from .decoding.shortlist import SHORTLIST_FREQUENT, SHORTLIST_PER_SOURCE
from .files import check_input_file, check_output_file, new_folder
from .gpu_policy import default_device
from .kernels.allocator import reuse_freed_memory
from .model.errors_vaswani import UsageError
from .serving.settings import ServingSettings
from .text_io import PipeClosed
from .training.settings import DEMO_SETTINGS, RecipeSettings, setting_flag


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, its mistakes as the package's: one line `PROG: error: ...` (no usage above it), exit code
    2. A command's parser refuses the options it does not know itself, so that the line names the command: argparse
    would hand them up to `vaswani`'s parser."""

    def parse_known_args(self, args=None, namespace=None) -> tuple[argparse.Namespace, list[str]]:
        namespace, unknown = super().parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return namespace, unknown

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def option_flag(name: str) -> str:
    """The command-line option of the argparse destination `name`."""
    return "--" + name.replace("_", "-")


def parse_override(text: str) -> tuple[str, object]:
    """`key=value` with the value read as JSON when it parses (numbers, booleans), else as a string."""
    key, separator, value = text.partition("=")
    if not separator or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


class MergeKeyValue(argparse.Action):
    """Repeated KEY=VALUE options (parsed by `parse_override`) into one dict; a later KEY wins."""

    def __call__(self, parser, namespace, pair: tuple[str, object], option_string: str | None = None) -> None:
        key, value = pair
        setattr(namespace, self.dest, {**getattr(namespace, self.dest), key: value})  # the default stays untouched


def or_none(kind: type) -> typing.Callable[[str], object]:
    """The argparse type of an `X | None` setting: `none` (or `None`, as the help writes it) for None, undoing an
    earlier option such as a script's, else an X."""

    def parse(text: str) -> object:
        return None if text in ("none", "None") else kind(text)

    parse.__name__ = kind.__name__  # argparse names it in "invalid int value: ..."
    return parse


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per RecipeSettings field: its flag, type and default, its metadata as argparse keywords."""
    group = parser.add_argument_group(
        "recipe settings", "an option whose setting can be None takes `none` for it (the later of two options wins)"
    )
    defaults = RecipeSettings()
    for setting in fields(RecipeSettings):
        options = {key: value for key, value in setting.metadata.items() if key != "flag"}
        kind = setting.type
        optional = isinstance(kind, types.UnionType)
        if optional:  # `X | None`: the option takes an X, or none
            (kind,) = (member for member in typing.get_args(kind) if member is not type(None))
        kind = typing.get_origin(kind) or kind  # dict[str, Any] -> dict
        if kind is bool:  # `bool | None`: --flag and --no-flag, neither leaving the choice to the setting's None
            options["action"] = argparse.BooleanOptionalAction if optional else "store_true"
        elif kind is dict:
            options.update(type=parse_override, action=MergeKeyValue)
        else:
            options["type"] = or_none(kind) if optional else kind
            if optional and "choices" in options:
                options["choices"] = (*options["choices"], None)
        group.add_argument(
            setting_flag(setting.name), dest=setting.name, default=getattr(defaults, setting.name), **options
        )


def settings_from_args(args: argparse.Namespace) -> RecipeSettings:
    """The RecipeSettings of parsed `vaswani train` options; refuses bad settings (ValueError) before any work."""
    return RecipeSettings(**{setting.name: getattr(args, setting.name) for setting in fields(RecipeSettings)})


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("data")
    data.add_argument(
        "--data",
        choices=["synthetic", "files", "hub"],
        default="synthetic",
        help="the embedded corpus (seeded by --seed), local files, or a Hub translation dataset",
    )
    data.add_argument("--train", nargs="+", metavar="PATH", help="SRC TGT plain-text files, or one .tsv/.jsonl file")
    data.add_argument("--validation", nargs="+", metavar="PATH")
    data.add_argument("--test", nargs="+", metavar="PATH")
    data.add_argument("--hub-name", help="e.g. wmt14 (with --data hub)")
    data.add_argument("--hub-config", help="e.g. de-en (with --data hub)")
    data.add_argument("--source-lang", default="en")
    data.add_argument("--target-lang", default="de")


# The data options each --data kind reads: any other given is refused rather than ignored.
DATA_OPTIONS = {"synthetic": (), "files": ("train", "validation", "test"), "hub": ("hub_name", "hub_config")}


def check_data_arguments(args: argparse.Namespace) -> None:
    """Refuses (UsageError) a data option that the chosen --data kind would ignore, before any work."""
    for kind, names in DATA_OPTIONS.items():
        given = [option_flag(name) for name in names if getattr(args, name)]
        if kind != args.data and given:
            raise UsageError(f"{', '.join(given)}: --data {args.data} reads no such option (--data {kind} does)")


def load_data(args: argparse.Namespace):
    from .data.corpus import load_corpus

    if args.data == "synthetic":
        from .data.demo_corpus import make_synthetic_corpus

        return make_synthetic_corpus(seed=args.seed)
    if args.data == "hub":
        if not args.hub_name:
            raise UsageError("--data hub needs --hub-name")
        return load_corpus(
            "hub",
            name=args.hub_name,
            config=args.hub_config,
            source_lang=args.source_lang,
            target_lang=args.target_lang,
        )
    if not args.train or not args.test:
        raise UsageError("--data files needs --train and --test")
    splits = {
        name: paths[0] if len(paths) == 1 else tuple(paths)
        for name in ("train", "validation", "test")
        if (paths := getattr(args, name))
    }
    return load_corpus("files", **splits)


def command_demo(args: argparse.Namespace) -> None:
    from .data.demo_corpus import make_synthetic_corpus
    from .training.recipe import run_in_folder

    settings = replace(DEMO_SETTINGS, seed=args.seed)
    run = recipe_run(args, settings, dataset_name="hf_vaswani-synthetic-en-de")
    results = run_in_folder(run, lambda: make_synthetic_corpus(seed=args.seed))
    if results:
        print_summary(results, Path(args.output_dir))


def recipe_run(args: argparse.Namespace, settings: RecipeSettings, **record: str):
    """The recipe run the command line asks for: folder, settings, and what to do with a run already there."""
    from .training.recipe import RecipeRun

    return RecipeRun(args.output_dir, settings, args.resume, args.overwrite, command=args.command_line, **record)


def command_train(args: argparse.Namespace) -> None:
    from .training.recipe import run_in_folder

    settings = settings_from_args(args)  # first: bad settings stop the command before any data is read
    check_data_arguments(args)
    name = args.hub_name or ("hf_vaswani-synthetic-en-de" if args.data == "synthetic" else "custom")
    record = dict(source_lang=args.source_lang, target_lang=args.target_lang, dataset_name=name)
    results = run_in_folder(recipe_run(args, settings, **record), lambda: load_data(args))
    if results:
        print_summary(results, Path(args.output_dir))


def command_average(args: argparse.Namespace) -> None:
    from .training.averaging import average_checkpoints, last_checkpoints

    if not args.checkpoints and not args.checkpoint_dir:
        raise UsageError("give checkpoint folders or --checkpoint-dir")
    checkpoints = args.checkpoints or last_checkpoints(args.checkpoint_dir, args.last)
    with new_folder(args.output, "--output") as temporary:
        average_checkpoints(checkpoints, temporary)
    print(args.output)


def generation_options(args: argparse.Namespace) -> dict:
    """The decoding options given on the command line, checked (ValueError) before any model is loaded."""
    from .model.generation_vaswani import check_generation_settings, check_given_beam_settings

    names = ("num_beams", "length_penalty", "max_new_tokens")
    options = {name: value for name in names if (value := getattr(args, name)) is not None}
    flags = {name: option_flag(name) for name in names}
    check_generation_settings(options, flags)
    check_given_beam_settings(options, flags)
    return options


def check_shortlist(args: argparse.Namespace) -> None:
    """Refuses --shortlist for a model folder that holds none, before the model is loaded."""
    from .decoding.shortlist import SHORTLIST_FILE

    folder = args.model if isinstance(args.model, str) else args.model[0]  # an ensemble's: its first model's
    if args.shortlist and not (Path(folder) / SHORTLIST_FILE).is_file():
        raise UsageError(f"--shortlist: {folder} has no {SHORTLIST_FILE} (build one with `vaswani shortlist`)")


def translator_of(args: argparse.Namespace):
    """The decoding engine of a command's model folder (or folders, an ensemble), in the precision and on the device
    asked, with the (first) folder's shortlist if --shortlist."""
    from .decoding.translation import Translator

    return Translator(
        args.model,
        device=args.device,
        dtype=args.dtype,
        int8=args.int8,
        trust_remote_code=args.trust_remote_code,
        shortlist=args.shortlist,
    )


def command_shortlist(args: argparse.Namespace) -> None:
    from .data.corpus import load_parallel_files
    from .decoding.loading import load_model_folder
    from .decoding.shortlist import shortlist_of_corpus

    if not Path(args.model).is_dir():
        raise UsageError(f"{args.model} is not a model folder: the shortlist is saved into it")
    check_input_file(args.source, "--source")
    check_input_file(args.target, "--target")
    for option, value, least in (("--per-source", args.per_source, 1), ("--frequent", args.frequent, 0)):
        if value < least:
            raise UsageError(f"{option} must be at least {least}, got {value}")
    corpus = load_parallel_files(args.source, args.target)
    model, tokenizer = load_model_folder(args.model)
    shortlist = shortlist_of_corpus(
        tokenizer,
        list(corpus["source"]),
        list(corpus["target"]),
        model.config.vocab_size,
        args.per_source,
        args.frequent,
    )
    print(shortlist.save(args.model))


def check_not_an_input(output: Path, inputs: dict[str, Path | None]) -> None:
    """Refuses an output file that is one of the command's input files (`inputs`, by option), by path or through a
    link: the output replaces its file whole, and the input would be lost. The inputs exist: they are checked first."""
    for option, path in inputs.items():
        if path is not None and output.exists() and output.samefile(path):
            raise UsageError(f"--output {output} is the {option} file: writing the output would replace it")


def command_translate(args: argparse.Namespace) -> None:
    from .decoding.alignment import align_nbest, align_pairs, check_alignment_layer
    from .decoding.translation import check_batch_size, check_nbest, nbest_lines
    from .files import write_lines
    from .text_io import alignment_text, print_lines, read_sentences

    # Everything that can be checked is checked before the model is loaded and the input translated.
    if args.input:
        check_input_file(args.input, "--input")
    if args.output:
        check_output_file(args.output, "--output")
        check_not_an_input(args.output, {"--input": args.input})
    check_batch_size(args.batch_size, "--batch-size")
    options = generation_options(args)
    check_shortlist(args)
    if args.nbest is not None:
        check_nbest(args.nbest, options.get("num_beams"))
    if args.alignment_layer is not None and not args.alignments:
        raise UsageError("--alignment-layer has no effect without --alignments: leave one of them out")
    if args.alignments and len(args.model) > 1:
        raise UsageError("--alignments reads one model's attention: give one model, not an ensemble")
    alignment_layer = -1 if args.alignment_layer is None else args.alignment_layer
    translator = translator_of(args)
    model, tokenizer = translator.model, translator.tokenizer
    if args.alignments:
        check_alignment_layer(model, alignment_layer)
    if args.input:
        with open(args.input, "rb") as source:
            sentences = read_sentences(source, str(args.input))
    else:
        sentences = read_sentences(sys.stdin.buffer, "standard input")
    if args.nbest is not None:
        nbest = translator.translate_nbest(sentences, args.nbest, batch_size=args.batch_size, **options)
        alignments = (
            align_nbest(model, tokenizer, sentences, nbest, alignment_layer, args.batch_size)
            if args.alignments
            else None
        )
        lines = list(nbest_lines(nbest, alignments))
    else:
        lines = translator.translate(sentences, batch_size=args.batch_size, progress=sys.stderr.isatty(), **options)
        if args.alignments:
            alignments = align_pairs(model, tokenizer, sentences, lines, alignment_layer, args.batch_size)
            lines = [f"{line} ||| {alignment_text(pairs)}" for line, pairs in zip(lines, alignments, strict=True)]
    if args.output:
        write_lines(lines, args.output)
    else:
        print_lines(lines, sys.stdout)


# What `vaswani serve` needs beyond the package's dependencies: the extra `serve`.
SERVING_PACKAGES = ("starlette", "uvicorn", "python_multipart")


def command_serve(args: argparse.Namespace) -> None:
    from .serving.languages import language_pair

    settings = ServingSettings(**{setting.name: getattr(args, setting.name) for setting in fields(ServingSettings)})
    check_shortlist(args)
    pair = language_pair(args.model, args.source_lang, args.target_lang)
    try:
        from .serving.app import create_app
        from .serving.batcher import Batcher
        from .serving.server import listening_socket, serve
    except ModuleNotFoundError as error:
        package = (error.name or "").partition(".")[0]
        if package not in SERVING_PACKAGES:
            raise
        raise UsageError(f"serving needs {package}, not installed: pip install 'hf_vaswani[serve]'") from None
    listening = listening_socket(args.host, args.port)  # taken first: a port in use is refused before loading
    serve(create_app(Batcher(translator_of(args), settings), pair, settings), listening)


def command_score(args: argparse.Namespace) -> None:
    from .decoding.loading import load_model_folder
    from .decoding.scoring import score_lines, score_pairs
    from .decoding.translation import check_batch_size
    from .files import write_lines
    from .text_io import print_lines, read_sentences

    check_input_file(args.source, "--source")
    check_input_file(args.target, "--target")
    if args.output:
        check_output_file(args.output, "--output")
        check_not_an_input(args.output, {"--source": args.source, "--target": args.target})
    check_batch_size(args.batch_size, "--batch-size")
    with open(args.source, "rb") as source, open(args.target, "rb") as target:
        sources, targets = read_sentences(source, str(args.source)), read_sentences(target, str(args.target))
    if len(sources) != len(targets):
        raise UsageError(
            f"--source {args.source} has {len(sources)} lines but --target {args.target} has {len(targets)}"
        )
    model, tokenizer = load_model_folder(args.model, args.device, args.int8, args.trust_remote_code, args.dtype)
    scores = score_pairs(model, tokenizer, sources, targets, args.batch_size, args.normalize)
    if args.output:
        write_lines(score_lines(scores), args.output)
    else:
        print_lines(score_lines(scores), sys.stdout)


def command_evaluate(args: argparse.Namespace) -> None:
    from .data.corpus import load_parallel_files
    from .decoding.scoring import translate_and_score
    from .decoding.translation import check_batch_size
    from .text_io import print_lines

    check_input_file(args.source, "--source")
    check_input_file(args.reference, "--reference")
    check_batch_size(args.batch_size, "--batch-size")
    check_shortlist(args)
    test = load_parallel_files(args.source, args.reference)
    hypotheses, report = translate_and_score(
        translator_of(args),
        test["source"],
        test["target"],
        args.target_lang,
        batch_size=args.batch_size,
        progress=sys.stderr.isatty(),
    )
    report["sentences"] = len(hypotheses)
    print_lines(json.dumps(report, indent=2).split("\n"), sys.stdout)


def command_plot_attention(args: argparse.Namespace) -> None:
    from .decoding.loading import load_model_folder
    from .plots import plot_attention

    model, tokenizer = load_model_folder(args.model, trust_remote_code=args.trust_remote_code)
    for path in plot_attention(model, tokenizer, args.sentence, args.output_dir, layer=args.layer):
        print(path)


def command_convert(args: argparse.Namespace) -> None:
    from .interop.convert import convert_folder

    if not args.source.is_dir():
        raise UsageError(f"no model folder at {args.source}")
    with new_folder(args.output, "output folder") as temporary:
        convert_folder(args.source_kind, args.source, temporary)
    print(args.output)


def command_export(args: argparse.Namespace) -> None:
    from .decoding.loading import load_model_folder
    from .decoding.shortlist import Shortlist
    from .interop.export import decoding_note, write_ctranslate2

    with new_folder(args.output, "output folder") as temporary:  # refuses an existing folder before loading
        model, tokenizer = load_model_folder(args.model)
        shortlist = Shortlist.saved_in(args.model, model.config.vocab_size)
        write_ctranslate2(model, tokenizer, temporary, args.quantization, shortlist)
    print(args.output)
    # CTranslate2 models carry no decoding settings
    print(decoding_note(model.generation_config, shortlist is not None), file=sys.stderr)


def command_push(args: argparse.Namespace) -> None:
    from huggingface_hub.errors import HTTPError  # the base of its HTTP client's errors, connection errors included

    from .interop.hub import push_folder

    try:
        print(push_folder(args.folder, args.repo_id, private=args.private).commit_url)
    except (OSError, HTTPError) as error:  # HfHubHTTPError is both; OfflineModeIsEnabled an OSError
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UsageError(f"could not push {args.folder} to the Hub repo {args.repo_id}: {cause}") from None


def print_summary(results: dict, output_dir: Path) -> None:
    print(
        f"\nsacreBLEU {results['bleu']}  chrF2 {results['chrf']}  tokenized BLEU {results['tokenized_bleu']}  "
        f"({results['steps']} steps, {results['train_seconds']} s training, {results['total_seconds']} s in all)"
    )
    for example in results["examples"][:3]:
        print(
            f"  source:      {example['source']}\n  reference:   {example['reference']}\n"
            f"  translation: {example['translation']}\n"
        )
    print(
        f"model folder: {output_dir / 'model'}\nresults: {output_dir / 'results.json'}\n"
        f"curves: {output_dir / 'training_curves.png'}"
    )


def add_run_folder_arguments(parser: argparse.ArgumentParser) -> None:
    """The output folder of a training run, and what to do when it already holds one."""
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in OUTPUT_DIR from its newest complete checkpoint, with its tokenizer; the training "
        "corpus and settings must be the run's, except that --max-steps may grow and --num-beams, --length-penalty "
        "and --eval-batch-size may change (without a run there, start one)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run in OUTPUT_DIR (checkpoints, tokenizer, model, results) and start a new one; without "
        "--resume or --overwrite a folder holding a run is refused",
    )


def add_shortlist_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shortlist",
        action="store_true",
        help="score only the target tokens the model folder's shortlist lists for each batch (faster on CPU; built "
        "by `vaswani shortlist`)",
    )


def add_model_loading_arguments(parser: argparse.ArgumentParser, devices: bool = True) -> None:
    """How an inference command loads its model folder: device, int8, and whether the folder's code may run."""
    if devices:
        parser.add_argument("--device", default=default_device())
        parser.add_argument("--int8", action="store_true", help="int8 dynamic quantization of the Linear layers (CPU)")
        parser.add_argument(
            "--dtype",
            choices=["fp32", "bf16", "fp16"],
            default="fp32",
            help="float type of the weights and computation (bf16 or fp16: half the memory traffic, and the fast "
            "kernels of a GPU or of a CPU with AVX512-BF16, AMX or AVX512-FP16, on other CPUs refused); --int8 goes "
            "with fp32",
        )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="load a model of another type than vaswani with the Python code its folder ships (runs that code)",
    )


# The model argument of the commands that decode with a Translator.
ENSEMBLE_HELP = (
    "a saved model folder (or Hub id); several models sharing one vocabulary decode as an ensemble, from the mean of "
    "their probabilities, with the first one's tokenizer and decoding settings"
)


def build_parser() -> argparse.ArgumentParser:
    from .decoding.scoring import NORMALIZATIONS

    parser = CommandParser(prog="vaswani", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)  # each a CommandParser too

    demo = commands.add_parser("demo", help="the main job: corpus, tokenizer, training, averaging, BLEU, model folder")
    add_run_folder_arguments(demo)
    demo.add_argument("--seed", type=int, default=0, help="seed of the corpus, initial weights, data order and dropout")
    demo.set_defaults(handler=command_demo)

    train = commands.add_parser(
        "train",
        help="the paper's recipe on a corpus of your choice",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_run_folder_arguments(train)
    add_settings_arguments(train)
    add_data_arguments(train)
    train.set_defaults(handler=command_train)

    average = commands.add_parser("average", help="average checkpoints into one loadable model (§6.1)")
    average.add_argument("checkpoints", nargs="*", type=Path)
    average.add_argument("--checkpoint-dir", type=Path, help="take the last N checkpoint-* folders of this directory")
    average.add_argument("--last", type=int, default=5)
    average.add_argument("--output", required=True, type=Path)
    average.set_defaults(handler=command_average)
    translate = commands.add_parser("translate", help="translate a file or stdin, one sentence a line")
    translate.add_argument("model", nargs="+", metavar="MODEL", help=ENSEMBLE_HELP)
    translate.add_argument("--input", type=Path, help="default: stdin")
    translate.add_argument("--output", type=Path, help="default: stdout")
    translate.add_argument("--batch-size", type=int, default=64)
    translate.add_argument("--num-beams", type=int, help="default: the model's generation config (paper: 4)")
    translate.add_argument("--length-penalty", type=float, help="GNMT alpha; default: the model's (paper: 0.6)")
    translate.add_argument("--max-new-tokens", type=int, help="an absolute cap on top of source length + 50")
    translate.add_argument(
        "--nbest",
        type=int,
        metavar="K",
        help="print the K best hypotheses of beam search per sentence, best first, in Moses' n-best format: "
        "'i ||| hypothesis ||| LogProb= L Tokens= N ||| score', i the 0-based line number, L the sum of the token "
        "log-probabilities beam search used, N the output tokens (</s> included), score = L / the model's length "
        "penalty (GNMT's ((5 + N) / 6)^alpha, or N^alpha for length_penalty_type power); beam size: --num-beams, at "
        "least K (default: the larger of K and the model's)",
    )
    translate.add_argument(
        "--alignments",
        action="store_true",
        help="append ' ||| i-j ...' to each translation (or n-best line): source word i aligned to target word j "
        "(0-based, whitespace-separated words), each target word to the source word it attends to most in the "
        "encoder-decoder attention of --alignment-layer, averaged over heads, with the translation teacher-forced; "
        "a target word's attention is the mean over its subword tokens, a source word's the sum over its tokens",
    )
    translate.add_argument(
        "--alignment-layer", type=int, help="decoder layer of --alignments, 0-based; -1 is the last (the default)"
    )
    add_shortlist_argument(translate)
    add_model_loading_arguments(translate)
    translate.set_defaults(handler=command_translate)

    score = commands.add_parser(
        "score",
        help="log-probability of given translations under the model (forced decoding)",
        description="Score each target line as the translation of its source line. One output line per pair: "
        "'score<TAB>log-probability<TAB>token log-probabilities', the log-probabilities natural logarithms, one per "
        "target token (</s> included), and score the log-probability normalised by --normalize.",
    )
    score.add_argument("model", help="a saved model folder (or Hub id)")
    score.add_argument("--source", required=True, type=Path, help="source sentences, one a line")
    score.add_argument("--target", required=True, type=Path, help="their translations, line by line")
    score.add_argument("--output", type=Path, help="default: stdout")
    score.add_argument(
        "--normalize",
        choices=NORMALIZATIONS,
        default="none",
        help="score = the log-probability as is, per target token, or divided by the model's length penalty (as beam "
        "search ranks hypotheses, so comparable with translate --nbest scores)",
    )
    score.add_argument("--batch-size", type=int, default=64)
    add_model_loading_arguments(score)
    score.set_defaults(handler=command_score)

    serve = commands.add_parser(
        "serve",
        help="serve translations over HTTP, LibreTranslate's API, concurrent requests decoded in shared batches",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("model", help="a saved model folder")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=5000, help="0: a free port, named in the log")
    serve.add_argument("--source-lang", help="the model's source language, where its folder does not record it")
    serve.add_argument("--target-lang", help="the model's target language, where its folder does not record it")
    for setting in fields(ServingSettings):
        serve.add_argument(
            option_flag(setting.name), type=setting.type, default=setting.default, help=setting.metadata["help"]
        )
    add_shortlist_argument(serve)
    add_model_loading_arguments(serve)
    serve.set_defaults(handler=command_serve)

    evaluate = commands.add_parser(
        "evaluate", help="translate a test set and score it: sacreBLEU, chrF2, tokenized BLEU"
    )
    evaluate.add_argument("model", nargs="+", metavar="MODEL", help=ENSEMBLE_HELP)
    evaluate.add_argument("--source", required=True, type=Path, help="source sentences, one a line (.gz allowed)")
    evaluate.add_argument("--reference", required=True, type=Path, help="reference translations, line by line")
    evaluate.add_argument("--target-lang", default="de", help="language of the Moses tokenizer for tokenized BLEU")
    evaluate.add_argument("--batch-size", type=int, default=64)
    add_shortlist_argument(evaluate)
    add_model_loading_arguments(evaluate)
    evaluate.set_defaults(handler=command_evaluate)

    plot = commands.add_parser("plot-attention", help="heatmaps of all heads of a layer for one sentence (PNG)")
    plot.add_argument("model", help="a saved model folder (or Hub id)")
    plot.add_argument("--sentence", required=True)
    plot.add_argument("--layer", type=int, default=-1, help="0-based; -1 is the last layer")
    plot.add_argument("--output-dir", type=Path, default=Path("attention_plots"))
    add_model_loading_arguments(plot, devices=False)
    plot.set_defaults(handler=command_plot_attention)
    convert = commands.add_parser("convert", help="convert a MarianMT (OPUS-MT) or FSMT folder exactly (same logits)")
    convert.add_argument("--from", dest="source_kind", choices=["marian", "fsmt"], required=True)
    convert.add_argument("source", type=Path, help="a saved MarianMTModel or FSMTForConditionalGeneration folder")
    convert.add_argument("output", type=Path)
    convert.set_defaults(handler=command_convert)

    shortlist = commands.add_parser(
        "shortlist",
        help="build the model's vocabulary shortlist from a parallel corpus, into its folder (translate --shortlist)",
        description="For each source token, its target tokens of highest Dice coefficient over the corpus's sentence "
        "pairs; with the most frequent target tokens and the special tokens always listed. Written to the model "
        "folder as shortlist.safetensors (and by `vaswani export` as CTranslate2's vocabulary map).",
    )
    shortlist.add_argument("model", help="a saved model folder")
    shortlist.add_argument("--source", required=True, type=Path, help="source sentences, one a line (.gz allowed)")
    shortlist.add_argument("--target", required=True, type=Path, help="their translations, line by line")
    shortlist.add_argument(
        "--per-source", type=int, default=SHORTLIST_PER_SOURCE, help="target tokens listed per source token"
    )
    shortlist.add_argument(
        "--frequent", type=int, default=SHORTLIST_FREQUENT, help="most frequent target tokens, always listed"
    )
    shortlist.set_defaults(handler=command_shortlist)

    export = commands.add_parser("export", help="write a CTranslate2 model (and our tokenizer) translating the same")
    export.add_argument("--to", dest="target", choices=["ctranslate2"], required=True, help="the target format")
    export.add_argument("model", help="a saved model folder (or Hub id)")
    export.add_argument("output", type=Path, help="a new folder")
    export.add_argument(
        "--quantization",
        default="float32",
        help="CTranslate2 weight type: float32 (default), int8, int8_float32, int8_float16, int8_bfloat16, int16, "
        "float16, bfloat16",
    )
    export.set_defaults(handler=command_export)

    push = commands.add_parser("push", help="upload a model folder to the Hub (safetensors, code, tokenizer, card)")
    push.add_argument("folder", type=Path)
    push.add_argument("repo_id")
    push.add_argument("--private", action="store_true")
    push.set_defaults(handler=command_push)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["vaswani", *(sys.argv[1:] if argv is None else argv)])  # recorded with results
    from safetensors import SafetensorError

    if argv is None:  # the console script owns its process; a Python caller's allocator is the caller's to set
        reuse_freed_memory()  # steps that free and allocate the same tensors skip the page faults (allocator.py)
    try:
        args.handler(args)
    except PipeClosed:
        # Python's documented SIGPIPE handling: stdout goes to /dev/null, or the interpreter's flush of it at exit
        # fails again. Exit 0, so that `vaswani translate ... | head -1` succeeds under `set -o pipefail`.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0) from None
    # The user's mistake (the package's UsageError), a missing or unwritable file, damaged weights: one line naming
    # it, exit code 2. Anything else is a bug and keeps its traceback, with a note saying so.
    except (UsageError, OSError, SafetensorError) as error:
        message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
        print(f"vaswani {args.command}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from error
    except Exception as error:
        error.add_note(
            f"vaswani {args.command}: this is a bug in hf_vaswani, not a mistake in the command: please report it "
            "with the command line and this traceback"
        )
        raise


if __name__ == "__main__":
    main()
