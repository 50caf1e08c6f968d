"""`k2trt` — one command, with a subcommand per job. Each subcommand lives in its own module, imported only
when it runs, so `k2trt inspect` never imports TensorRT or ONNX Runtime.

Bad input of any kind ends in one line, `k2trt COMMAND: error: ...`, and exit status 2 — a bad argument too
(the usage is one `--help` away) — and ^C at any moment, importing included, in `k2trt COMMAND: interrupted`
and status 130."""

from __future__ import annotations

import argparse
import importlib
import sys

from k2trt.errors import READER_GONE, K2Error

# subcommand -> (module, one-line help). Each module has add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "make-tiny": ("k2trt.commands.make_tiny", "write the embedded tiny K2 checkpoint (K2's exact on-disk format)"),
    "inspect": ("k2trt.commands.inspect",
                "parameter table of a checkpoint or preset, cross-checked against headers"),
    "export": ("k2trt.commands.export", "export per-block ONNX graphs (TensorRT-bound and ONNX Runtime forms)"),
    "build": ("k2trt.commands.build", "build TensorRT engines from the exported graphs (needs TensorRT + GPU)"),
    "generate": ("k2trt.commands.generate", "generate text through the exported graphs or engines"),
    "chat": ("k2trt.commands.chat", "interactive chat with history"),
    "bench": ("k2trt.commands.bench", "prefill/decode tokens/s of the runtime against transformers and the torch "
                                   "reference (or pipeline stages against one process)"),
    "compare": ("k2trt.commands.compare", "accuracy of each backend against the torch reference, via polygraphy"),
    "serve": ("k2trt.commands.serve", "an OpenAI-compatible HTTP server with continuous batching"),
    "bench-serve": ("k2trt.commands.bench_serve",
                    "concurrent clients over HTTP against a live server: tokens/s, TTFT, ITL"),
    "plan": ("k2trt.commands.plan", "split the model over N devices as pipeline stages, by exact bytes"),
    "doctor": ("k2trt.commands.doctor", "check the TensorRT path on this machine: versions, plugins, engines, tokens"),
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a bad argument reported as one line (argparse prints the usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="k2trt", description=__doc__)
    parser.add_argument("--version", action="version", version=f"k2trt {__import__('k2trt').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=ArgumentParser)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Parsers are filled lazily in main() for the chosen command only.
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    try:
        return _main(argv)
    except SystemExit as e:  # argparse: --help (0) or a bad argument (2), its line already printed
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 2
    except KeyboardInterrupt:  # also while a subcommand's heavy imports (torch, ONNX Runtime) are loading
        from k2trt.runtime.distributed.launcher_link import under_launcher

        if not under_launcher():  # a pipeline rank: its launcher says it once for every rank
            print(f"k2trt{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    parser = build_parser()
    # Find the subcommand, then let its module declare the arguments.
    known, _ = parser.parse_known_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    module = importlib.import_module(known._module)
    full = ArgumentParser(prog=f"k2trt {known.command}", description=COMMANDS[known.command][1])
    module.add_arguments(full)
    args = full.parse_args(argv[1:])
    args.argv = argv  # a command that launches pipeline ranks starts them with the same arguments
    from k2trt.runtime.distributed.launcher_link import LostContact, watch_launcher

    watch_launcher()  # a rank our launcher started ends with it
    try:
        return int(module.run(args) or 0)
    except K2Error as e:
        return _fail(known.command, " ".join(str(e).splitlines()), lost=isinstance(e, LostContact))
    except BrokenPipeError:  # `k2trt plan | head`: the reader left, which is not an error of ours
        return _reader_gone()
    except OSError as e:  # a path the user gave that cannot be read or written
        where = f": {e.filename}" if e.filename else ""
        return _fail(known.command, f"{e.strerror or e}{where}")


def _reader_gone() -> int:
    """Quiet exit when stdout's reader closed the pipe; stdout is pointed at /dev/null so that the interpreter's
    final flush does not raise again (the recipe in Python's `signal` documentation)."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return READER_GONE


def _fail(command: str, message: str, lost: bool = False) -> int:
    """One line for the user. A pipeline rank our launcher started tells the launcher instead, which prints the
    first failure of all its ranks once (`lost`: this rank only lost contact with another)."""
    from k2trt.runtime.distributed.world import report_to_launcher

    if report_to_launcher(message, lost):
        return 2
    print(f"k2trt {command}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
