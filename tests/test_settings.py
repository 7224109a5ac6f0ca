"""One name, one default, one place for every setting: the CLI's flags, the settings objects and the code agree.

These tests fail when a default is written twice (a flag with its own literal default, a second dataclass or
keyword default with the same value) or when an old name of a setting comes back.
"""

from __future__ import annotations

import ast
import re
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import pytest

from mirror_rt.cli import build_parser
from mirror_rt.devices.options import DeviceConfig, PrecisionConfig, SourceConfig
from mirror_rt.exporters.export import ExportConfig
from mirror_rt.models.config import SplitConfig
from mirror_rt.runtime.config import GenerationConfig
from mirror_rt.runtime.sampling import SamplingConfig
from mirror_rt.serving.settings import ClusterConfig, ServerConfig

ROOT = Path(__file__).resolve().parents[1]
CODE = ["runtime", "models", "exporters", "devices", "evaluation", "training", "serving", "mirror_rt"]
# Each settings object, and the module that is the one home of its defaults.
HOMES = {GenerationConfig: "runtime/config.py", SamplingConfig: "runtime/sampling.py",
         SourceConfig: "devices/options.py", DeviceConfig: "devices/options.py",
         PrecisionConfig: "devices/options.py", SplitConfig: "models/config.py",
         ServerConfig: "serving/settings.py", ClusterConfig: "serving/settings.py",
         ExportConfig: "exporters/export.py"}
# A flag whose None means "not asked for" rather than the field's default: --replicas (absent: no Ray at all).
NOT_GIVEN = {("serve", "replicas")}
REQUIRED = {"run": [], "serve": [], "bench": ["--data", "q.jsonl", "--out", "o"], "export": ["--out", "o"]}


def default(field):
    if field.default is not MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not MISSING else MISSING


def settings_defaults(command: str) -> dict:
    """Every settings field a flag of `command` may name, with its one default (sampling fields flat)."""
    kinds = {"export": [ExportConfig],
             "serve": [GenerationConfig, SamplingConfig, SourceConfig, DeviceConfig, PrecisionConfig, SplitConfig,
                       ServerConfig, ClusterConfig]}.get(command, [GenerationConfig, SamplingConfig, SourceConfig,
                                                                     DeviceConfig, PrecisionConfig, SplitConfig])
    found = {}
    for kind in kinds:
        for f in fields(kind):
            value = default(f)
            if value is not MISSING and not is_dataclass(value) and f.name != "defaults":
                found.setdefault(f.name, value)
    return found


def parsed_defaults(command: str) -> dict:
    return vars(build_parser().parse_args([command, *REQUIRED[command]]))


@pytest.mark.parametrize("command", ["run", "serve", "bench", "export"])
def test_every_flag_default_is_its_settings_default(command):
    """Parse a subcommand with no options: each flag that names a settings field holds that field's default."""
    expected, parsed = settings_defaults(command), parsed_defaults(command)
    checked = 0
    for name, value in parsed.items():
        if name not in expected or (command, name) in NOT_GIVEN:
            continue
        want = expected[name]
        assert (tuple(value) if isinstance(value, list) else value) == want, (command, name, value, want)
        checked += 1
    assert checked >= {"run": 25, "serve": 30, "bench": 15, "export": 10}[command]  # the groups are there


def test_run_serve_and_bench_share_their_generation_flags_and_defaults():
    """The decoding flags are the same in run, serve and bench; the request flags in run and bench."""
    run, serve, bench = (parsed_defaults(c) for c in ("run", "serve", "bench"))
    decoding = ("gamma", "branch_budget", "draft_lookup", "early_exit", "sampling_verify")
    request = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_strings")
    assert all(run[n] == serve[n] == bench[n] for n in decoding)
    assert all(run[n] == bench[n] for n in request)
    assert run["mode"] == serve["mode"] is None  # the engine's default mode, as the API's


def _literal_defaults(path: Path):
    """(line, dest, value) of every `add_argument(..., default=<literal>)` in a CLI module."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
        keywords = {k.arg: k.value for k in node.keywords}
        dest = keywords["dest"].value if "dest" in keywords else (flags[0][2:].replace("-", "_") if flags else None)
        value = keywords.get("default")
        if isinstance(value, ast.Constant) and value.value not in (None, False):
            yield node.lineno, dest, value.value


def test_no_cli_flag_writes_a_settings_default_of_its_own():
    """A flag naming a settings field takes its default from the settings object, never as a literal."""
    fields_anywhere = {f.name for kind in HOMES for f in fields(kind)}
    offenders = [f"{path.name}:{line} --{dest} default={value!r}"
                 for path in sorted((ROOT / "mirror_rt" / "cli").glob("*.py"))
                 for line, dest, value in _literal_defaults(path) if dest in fields_anywhere]
    assert not offenders


def _code_files():
    for folder in CODE:
        yield from sorted((ROOT / folder).rglob("*.py"))  # (rglob does not follow mirror_rt/'s links)


TRIVIAL = (None, True, False, 0, 1, "", (), 0.0, 1.0)


def test_each_default_is_written_in_its_home_only():
    """`<field> = <its default>` or `<field>: ... = <its default>` appears in the settings object's own module
    only: a second dataclass, a keyword default or a fallback (`kappa or 8`) with the same value fails."""
    offenders = []
    texts = {path: path.read_text() for path in _code_files()}
    for kind, home in HOMES.items():
        for f in fields(kind):
            value = default(f)
            if value is MISSING or value in TRIVIAL or is_dataclass(value) or isinstance(value, (dict, list)):
                continue
            literal = re.escape(repr(value))
            pattern = re.compile(rf"\b{f.name}\s*(?::[^=\n]*)?=\s*{literal}(?![\w.])|\b{f.name} or {literal}\b")
            for path, text in texts.items():
                if path.relative_to(ROOT).as_posix() != home:
                    offenders += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not offenders


OLD_NAMES = [
    (r"num_draft_tokens(?<!spec_decode_num_draft_tokens)", "gamma"),  # vLLM's metric name stays a metric name
    (r"(?<![\w.])lookup=", "draft_lookup="),
    (r"\bdraft_ref\b|\bmodel_ref\b", "draft_model / model"),
    (r"\btorch_options\b", "EngineConfig"),
    (r"\brequest_timeout_s\b|\bdrain_s\b|\bplacement_timeout_s\b", "request_timeout / drain_timeout / "
                                                                     "placement_timeout"),
    (r"\btarget_device=|\bdraft_device=", "target= / draft= (DeviceConfig)"),
    (r"getattr\(engine, \"(placement|manifest)\"", "engine.placement / engine.manifest (declared fields)"),
    (r"\b(Engine|Model|Device|Precision|Split)Options\b|\b(Batch|Draft|Server|Cluster|Bench)Settings\b",
     "one suffix for settings objects: EngineConfig, SourceConfig, DeviceConfig, PrecisionConfig, SplitConfig, "
     "BatchConfig, DraftConfig, ServerConfig, ClusterConfig, BenchConfig"),
]


@pytest.mark.parametrize("pattern,new", OLD_NAMES)
def test_old_setting_names_are_gone_from_code(pattern, new):
    """A setting keeps one name from flag to field: the old spellings are nowhere in the code folders."""
    regex = re.compile(pattern)
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in _code_files()
            for n, line in enumerate(path.read_text().splitlines(), 1) if regex.search(line)]
    assert not hits, f"use {new}: {hits}"


def test_one_placement_class():
    """`Placement` names one concept (where each worker runs), defined once."""
    defined = [path.relative_to(ROOT).as_posix() for path in _code_files()
               if re.search(r"^class Placement\b", path.read_text(), re.M)]
    assert defined == ["devices/placement.py"]


def test_no_module_of_runtime_devices_serving_passes_400_lines():
    long = {path.relative_to(ROOT).as_posix(): n for folder in ("runtime", "devices", "serving")
            for path in (ROOT / folder).rglob("*.py") if (n := len(path.read_text().splitlines())) > 400}
    assert not long


def test_export_draft_is_refused_in_one_line_naming_the_new_flag(capsys):
    """`export --draft` (a device elsewhere) is now `--draft-model`: the old spelling is one error line."""
    from mirror_rt.cli import main

    assert main(["export", "--draft", "tiny", "--out", "nowhere"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mirror-rt: error:") and "--draft-model" in err[0]


def test_sampling_verify_has_one_name_from_flag_to_field_to_request():
    """`--sampling-verify`, `GenerationConfig.sampling_verify` and a request's `sampling_verify`: one name, the
    field's default when none is given, a bad value refused in one line (CLI) or a 400 (request)."""
    from mirror_rt.cli.options import generation_config
    from mirror_rt.runtime.config import make_config
    from mirror_rt.serving.errors import APIError
    from mirror_rt.serving.protocol import CompletionRequest, parse

    parser = build_parser()
    assert generation_config(parser.parse_args(["run", "hi"])).sampling_verify == GenerationConfig().sampling_verify
    assert generation_config(parser.parse_args(["run", "hi", "--sampling-verify", "exact-seed"])).sampling_verify \
        == "exact-seed"
    asked = parse(CompletionRequest, {"prompt": "hi", "sampling_verify": "exact-seed"}).fields()
    assert make_config(**asked).sampling_verify == "exact-seed"
    assert "sampling_verify" not in parse(CompletionRequest, {"prompt": "hi"}).fields()  # the server's default
    with pytest.raises(APIError):
        parse(CompletionRequest, {"prompt": "hi", "sampling_verify": "coupled"})
    with pytest.raises(ValueError, match="--sampling-verify must be rejection or exact-seed"):
        GenerationConfig(sampling_verify="coupled")
