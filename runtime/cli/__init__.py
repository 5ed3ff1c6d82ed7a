"""The ``tessera`` command: compile, run, report, ir, generate, perplexity, cache (one module per command
here), serve and batch (runtime/serving/cli.py and batch_cli.py, beside the engine they start).

Every user error (a spec error, a bad --set, a weights file that does not
fit, a run input of the wrong shape) prints a clear message and exits with
status 2; a traceback means a bug in Tessera.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from tessera.runtime.cli import args as shared
from tessera.runtime.cli import cache, compile as compile_cmd, generate, ir, perplexity, report, run
from tessera.runtime.serving import batch_cli as batch, cli as serve
from tessera.runtime.errors import UsageError

# the user errors that print one line and exit 2, by the module defining each: looked up only once an
# error is raised (a module not imported yet cannot have raised its error), so that `tessera --help`
# imports neither onnx nor the compiler
USER_ERRORS = [("tessera.compiler.backends.atomic", "OutputError"), ("tessera.compiler.ir.signature", "InputError"),
               ("tessera.runtime.io.weights", "WeightsError"), ("tessera.runtime.session", "ProviderError"),
               ("tessera.runtime.session", "RunError"), ("tessera.runtime.session", "ModelFileError")]


def _is_user_error(e: BaseException) -> bool:
    if isinstance(e, UsageError):
        return True
    for module, name in USER_ERRORS:
        m = sys.modules.get(module)
        if m is not None and isinstance(e, getattr(m, name)):
            return True
    return False

EPILOG = """SPEC is a spec file (.tsr) or the name of a bundled spec ({bundled});
a path wins when that file exists.

examples:
  tessera report gpt2 --variant small
  tessera compile gpt2 --set layers=2 -o out/gpt2-tiny.onnx
  tessera run out/gpt2-tiny.onnx --input 'tokens=[[464, 2068, 7586]]'
  tessera run worked_example --input 'x=[[1,0],[0,1],[1,1]]'
  tessera report models/gpt2.tsr --variant small      (a spec file of your own)
  tessera run bert -V minilm_l6 --weights model.safetensors --tokenizer tokenizer.json \\
      --text "A man is eating food." --text "A man is eating a meal." --pool mean
  tessera run vit -V b16 --weights vit-b16.safetensors --image cat.png
"""


# every subcommand: its module registers the parser (add_parser) and does the work (cmd_<name>)
COMMANDS = {"compile": (compile_cmd, compile_cmd.cmd_compile), "run": (run, run.cmd_run),
            "report": (report, report.cmd_report), "ir": (ir, ir.cmd_ir), "generate": (generate, generate.cmd_generate),
            "serve": (serve, serve.cmd_serve), "batch": (batch, batch.cmd_batch),
            "perplexity": (perplexity, perplexity.cmd_perplexity), "cache": (cache, cache.cmd_cache)}


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors suggest the closest flag or subcommand (``--varient``: did you
    mean --variant?): a misspelt option otherwise gets only 'unrecognized arguments'."""

    def error(self, message: str):
        hint = _suggestion(self, message)
        super().error(message + hint)

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but a subcommand's unknown flag is reported by that subcommand's parser
        (its usage line, its flags to suggest from)."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            subs = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
            chosen = subs[0].choices.get(getattr(ns, "command", None)) if subs else None
            (chosen or self).error("unrecognized arguments: " + " ".join(extras))
        return ns


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    import difflib
    import re

    if message.startswith("unrecognized arguments:"):
        known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        hints = []
        for word in message.split(":", 1)[1].split():
            flag = word.split("=", 1)[0]
            if flag.startswith("-"):
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
                if close:
                    hints.append(f"{flag}: did you mean {close[0]}?")
        return ("; " + "; ".join(hints)) if hints else ""
    m = re.search(r"invalid choice: '([^']*)'", message)
    if m:
        choices = re.findall(r"'([^']*)'", message.split("choose from", 1)[-1])
        close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
        return f"; did you mean {close[0]}?" if close else ""
    return ""


def make_parser() -> argparse.ArgumentParser:
    from tessera import __version__

    parser = Parser(
        prog="tessera", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG.format(bundled=shared.bundled()),
        description="Compile transformer specs (.tsr) to ONNX, run them in onnxruntime, and report their cost.")
    parser.add_argument("--version", action="version", version=f"tessera {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for module, handler in COMMANDS.values():
        module.add_parser(sub).set_defaults(handler=handler)
    return parser


class _Terminated(BaseException):
    """SIGTERM, raised where the program is so that cleanup (temporary output files) runs."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("interrupted; no output was changed", file=sys.stderr)
        return 130
    except _Terminated:
        print("terminated; no output was changed", file=sys.stderr)
        return 143
    except BrokenPipeError:  # output piped into head and closed early
        sys.stderr.close()
        return 0
    except Exception as e:
        spec = sys.modules.get("tessera.spec.diagnostics")
        if spec is not None and isinstance(e, spec.SpecError):
            print(e.render(), file=sys.stderr)
        elif _is_user_error(e):
            print(f"error: {e}", file=sys.stderr)
        else:
            raise
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
    return 2
