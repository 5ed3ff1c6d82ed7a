"""The ``tessera`` command: compile, run, report, ir, generate (one module per command here), and serve
(runtime/serving/cli.py, beside the engine it starts).

Every user error (a spec error, a bad --set, a weights file that does not
fit, a run input of the wrong shape) prints a clear message and exits with
status 2; a traceback means a bug in Tessera.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from tessera.compiler.backends.onnx.export import OutputError
from tessera.compiler.ir.signature import InputError
from tessera.spec import SpecError

from tessera.runtime.cli import args as shared
from tessera.runtime.cli import compile as compile_cmd, generate, ir, report, run
from tessera.runtime.serving import cli as serve
from tessera.runtime.io.weights import WeightsError
from tessera.runtime.pipeline import UsageError

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
            "serve": (serve, serve.cmd_serve)}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG.format(bundled=shared.bundled()),
        description="Compile transformer specs (.tsr) to ONNX, run them in onnxruntime, and report their cost.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
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
    except SpecError as e:
        print(e.render(), file=sys.stderr)
    except (UsageError, WeightsError, InputError, OutputError) as e:
        print(f"error: {e}", file=sys.stderr)
    except BrokenPipeError:  # output piped into head and closed early
        sys.stderr.close()
        return 0
    except Exception as e:
        from tessera.runtime.session import ModelFileError, ProviderError, RunError

        if isinstance(e, (ProviderError, RunError, ModelFileError)):
            print(f"error: {e}", file=sys.stderr)
        else:
            raise
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
    return 2
