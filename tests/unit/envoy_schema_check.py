"""Check Envoy bootstrap files against Envoy's v3 API: `python envoy_schema_check.py FILE...`.

Run in a subprocess whose PYTHONPATH starts with an xds-protos install (see
tests/unit/deploy_tools.py): xds-protos ships its own `opentelemetry.proto` and `google.*`
modules, which must not mix with the ones the services import.

Each file is parsed with json_format.ParseDict into envoy.config.bootstrap.v3.Bootstrap
(unknown fields, wrong types and unknown enum values are errors; every typed_config Any is
resolved by its @type and parsed as that message), then the protoc-gen-validate rules that
Envoy itself enforces at load time are checked: required messages and oneofs, string and
repeated minimums, numeric and duration bounds, defined enums. Prints one line per problem;
exit 1 if there was any."""
from __future__ import annotations

import importlib
import pkgutil
import sys

import yaml
from google.protobuf import any_pb2, descriptor, json_format, symbol_database

for _pkg in ("envoy", "xds", "udpa", "validate"):  # register every message type for Any
    _mod = importlib.import_module(_pkg)
    for _info in pkgutil.walk_packages(_mod.__path__, f"{_pkg}."):
        if _info.name.endswith("_pb2"):
            importlib.import_module(_info.name)

from envoy.config.bootstrap.v3 import bootstrap_pb2  # noqa: E402
from validate import validate_pb2  # noqa: E402

FD = descriptor.FieldDescriptor


def _duration_s(d) -> float:
    return d.seconds + d.nanos / 1e9


def _check_scalar(path: str, rules, value, problems: list[str]) -> None:
    kind = rules.WhichOneof("type")
    if kind is None:
        return
    r = getattr(rules, kind)
    if kind == "string":
        if r.HasField("min_len") and len(value) < r.min_len:
            problems.append(f"{path}: shorter than {r.min_len}")
        if r.HasField("min_bytes") and len(value.encode()) < r.min_bytes:
            problems.append(f"{path}: shorter than {r.min_bytes} bytes")
        if r.HasField("const") and value != r.const:
            problems.append(f"{path}: must be {r.const!r}")
        allowed = list(getattr(r, "in"))  # `in` is a Python keyword
        if allowed and value not in allowed:
            problems.append(f"{path}: {value!r} not in {allowed}")
    elif kind in ("uint32", "uint64", "int32", "int64", "double", "float"):
        for bound, ok in (("gt", lambda b: value > b), ("gte", lambda b: value >= b),
                          ("lt", lambda b: value < b), ("lte", lambda b: value <= b)):
            if r.HasField(bound) and not ok(getattr(r, bound)):
                problems.append(f"{path}: {value} violates {bound} {getattr(r, bound)}")
    elif kind == "enum":
        pass  # defined_only is checked by ParseDict (names) for every enum we write


def _check(msg, path: str, problems: list[str]) -> None:
    if isinstance(msg, any_pb2.Any):
        if not msg.type_url:
            return
        inner = symbol_database.Default().GetSymbol(msg.TypeName())()
        msg.Unpack(inner)
        _check(inner, f"{path}<{msg.TypeName()}>", problems)
        return
    desc = msg.DESCRIPTOR
    for oneof in desc.oneofs:
        if oneof.GetOptions().Extensions[validate_pb2.required] and msg.WhichOneof(oneof.name) is None:
            problems.append(f"{path}: one of {oneof.name} ({', '.join(f.name for f in oneof.fields)}) is required")
    for field in desc.fields:
        rules = field.GetOptions().Extensions[validate_pb2.rules]
        name = f"{path}.{field.name}"
        repeated = field.is_repeated
        if repeated:
            values = getattr(msg, field.name)
            kind = rules.WhichOneof("type")
            if kind == "repeated" and rules.repeated.HasField("min_items") and len(values) < rules.repeated.min_items:
                problems.append(f"{name}: needs at least {rules.repeated.min_items} items")
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                items = values.values() if field.message_type.fields_by_name["value"].message_type else []
            elif field.type == FD.TYPE_MESSAGE:
                items = values
            else:
                items = []
            for i, item in enumerate(items):
                _check(item, f"{name}[{i}]", problems)
            continue
        if field.type == FD.TYPE_MESSAGE:
            present = msg.HasField(field.name)
            if rules.WhichOneof("type") == "message" and rules.message.required and not present:
                problems.append(f"{name}: required")
            if not present:
                continue
            sub = getattr(msg, field.name)
            if rules.WhichOneof("type") == "duration":
                d, r = _duration_s(sub), rules.duration
                for bound, ok in (("gt", lambda b: d > b), ("gte", lambda b: d >= b),
                                  ("lt", lambda b: d < b), ("lte", lambda b: d <= b)):
                    if r.HasField(bound) and not ok(_duration_s(getattr(r, bound))):
                        problems.append(f"{name}: {d}s violates {bound}")
            elif sub.DESCRIPTOR.full_name.startswith("google.protobuf.") and \
                    sub.DESCRIPTOR.full_name.endswith("Value") and hasattr(sub, "value"):
                _check_scalar(name, rules, sub.value, problems)  # wrapper types (UInt32Value, ...)
            _check(sub, name, problems)
        elif field.containing_oneof is None or msg.WhichOneof(field.containing_oneof.name) == field.name:
            _check_scalar(name, rules, getattr(msg, field.name), problems)


def check_file(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    boot = bootstrap_pb2.Bootstrap()
    try:
        json_format.ParseDict(data, boot)
    except json_format.ParseError as exc:
        return [f"{path}: {exc}"]
    problems: list[str] = []
    _check(boot, "Bootstrap", problems)
    return [f"{path}: {p}" for p in problems]


def main(paths: list[str]) -> int:
    problems = [p for path in paths for p in check_file(path)]
    for p in problems:
        print(p)
    print(f"checked {len(paths)} Envoy configs: {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
