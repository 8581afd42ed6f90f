"""Write the HTTP API reference page from the control plane's OpenAPI schema.

Builds the app as `minimill serve` does (`create_app`, over a throwaway SQLite store), takes
its OpenAPI schema, and renders every operation (grouped by tag) and every schema to Markdown.
Operator routes are left out of the schema a running server publishes (to anyone but an
operator they answer as unknown URLs); here they are included, marked as such. The schema
itself is written beside the page as `openapi.json`.

    python scripts/gen_api_reference.py docs/reference/http-api.md
"""

from __future__ import annotations

import copy
import json
import tempfile
from typing import Any

from page_args import output_page

TAG_ORDER = ["models", "chat", "completions", "responses", "files", "batches", "webhooks",
             "boxes", "agents", "operator", "fleet"]
TAG_NOTES = {
    "operator": "Operator keys (`mmo-`) only. These routes are not in the schema a server "
                "publishes at `/openapi.json`: to any other caller they answer 404, as an "
                "unknown URL would.",
    "fleet": "The worker protocol: site tokens (`mms-`) only. Sites pull work under leases "
             "(see [leases and fencing](../concepts/leases-and-fencing.md)).",
}
HEADER = """# HTTP API reference

Generated from the control plane's OpenAPI schema by `scripts/gen_api_reference.py` (run by
`make docs`); the schema itself: [openapi.json](openapi.json). A running server publishes the
same schema, without the operator routes, at `/openapi.json` and renders it at `/docs`.
Every error is an OpenAI error object, `{"error": {"message", "type", "param", "code"}}`,
and a body that does not validate is a 400 naming the parameter (never FastAPI's 422).
"""


def _hidden_routes() -> list[Any]:
    """Every route of minimill's routers that is left out of the published schema, as a copy
    that is included."""
    import importlib
    import pkgutil

    from fastapi.routing import APIRoute

    import minimill.api.routes as routes_pkg

    hidden = []
    for info in pkgutil.iter_modules(routes_pkg.__path__):
        router = getattr(importlib.import_module(f"{routes_pkg.__name__}.{info.name}"),
                         "router", None)
        for route in getattr(router, "routes", []):
            if isinstance(route, APIRoute) and not route.include_in_schema:
                shown = copy.copy(route)
                shown.include_in_schema = True
                hidden.append(shown)
    return hidden


def openapi_schema() -> dict[str, Any]:
    """The served app's schema, with the operator routes merged in."""
    from fastapi.openapi.utils import get_openapi

    from minimill.api.app import create_app
    from minimill.control.store import open_store

    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(f"sqlite:///{tmp}/openapi.db")
        try:
            schema = copy.deepcopy(create_app(store=store).openapi())
        finally:
            store.close()
    extra = get_openapi(title="operator", version="", routes=_hidden_routes())
    for path, item in extra.get("paths", {}).items():
        for operation in item.values():
            operation.get("responses", {}).pop("422", None)  # 400s here, as in the app
        schema["paths"].setdefault(path, {}).update(item)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, spec in extra.get("components", {}).get("schemas", {}).items():
        if name not in ("HTTPValidationError", "ValidationError"):
            components.setdefault(name, spec)
    return schema


def _anchor(name: str) -> str:
    return "schema-" + name.lower().replace("_", "-")


def type_of(schema: dict[str, Any]) -> str:
    """A short, readable type: links to named schemas, `a or b`, `array of x`."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_anchor(name)})"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            parts = [type_of(s) for s in schema[key]]
            return " or ".join(dict.fromkeys(parts))
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return type_of(schema["allOf"][0])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(type_of({**schema, "type": k}) for k in kind)
    if kind == "array":
        items = schema.get("items")
        return f"array of {type_of(items)}" if items else "array"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"object of {type_of(schema['additionalProperties'])}"
    if kind == "string" and schema.get("format") == "binary":
        return "file"
    return str(kind or "any")


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _operation(method: str, path: str, op: dict[str, Any]) -> list[str]:
    lines = [f"### `{method.upper()} {path}`", ""]
    if op.get("summary"):
        lines += [op["summary"].strip(), ""]
    if op.get("description") and op["description"] != op.get("summary"):
        lines += [op["description"].strip(), ""]
    params = op.get("parameters", [])
    if params:
        lines += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for p in params:
            lines.append(f"| `{p['name']}` | {p['in']} | {type_of(p.get('schema', {}))} | "
                         f"{'yes' if p.get('required') else ''} | "
                         f"{_cell(p.get('description', ''))} |")
        lines.append("")
    body = op.get("requestBody")
    if body:
        for media, content in body.get("content", {}).items():
            lines += [f"Request body (`{media}`): {type_of(content.get('schema', {}))}", ""]
    responses = op.get("responses", {})
    if responses:
        lines += ["| status | description | body |", "|---|---|---|"]
        for status, answer in responses.items():
            kinds = [type_of(c.get("schema", {})) + (f" (`{m}`)" if m != "application/json"
                                                     else "")
                     for m, c in answer.get("content", {}).items()]
            lines.append(f"| {status} | {_cell(answer.get('description', ''))} | "
                         f"{', '.join(kinds)} |")
        lines.append("")
    return lines


def _schema(name: str, schema: dict[str, Any]) -> list[str]:
    lines = [f"### {name} {{#{_anchor(name)}}}", ""]
    if schema.get("description"):
        lines += [schema["description"].strip(), ""]
    props = schema.get("properties")
    if not props:
        lines += [f"Type: {type_of(schema)}", ""]
        return lines
    required = set(schema.get("required", []))
    lines += ["| field | type | required | description |", "|---|---|---|---|"]
    for field, spec in props.items():
        default = f" Default: `{json.dumps(spec['default'])}`." if "default" in spec else ""
        lines.append(f"| `{field}` | {type_of(spec)} | {'yes' if field in required else ''} | "
                     f"{_cell(spec.get('description', ''))}{default} |")
    lines.append("")
    return lines


def render(schema: dict[str, Any]) -> str:
    by_tag: dict[str, list[list[str]]] = {}
    for path, item in schema["paths"].items():
        for method, op in item.items():
            tag = (op.get("tags") or ["other"])[0]
            by_tag.setdefault(tag, []).append(_operation(method, path, op))
    tags = sorted(by_tag, key=lambda t: (TAG_ORDER.index(t) if t in TAG_ORDER
                                          else len(TAG_ORDER), t))
    lines = [HEADER]
    for tag in tags:
        lines += [f"## {tag.capitalize()}", ""]
        if tag in TAG_NOTES:
            lines += [TAG_NOTES[tag], ""]
        for operation in by_tag[tag]:
            lines += operation
    lines += ["## Schemas", ""]
    for name, spec in sorted(schema.get("components", {}).get("schemas", {}).items()):
        lines += _schema(name, spec)
    return "\n".join(lines) + "\n"


def main() -> None:
    out = output_page("Write the HTTP API reference page.", "docs/reference/http-api.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    schema = openapi_schema()
    (out.parent / "openapi.json").write_text(json.dumps(schema, indent=1) + "\n")
    out.write_text(render(schema))


if __name__ == "__main__":
    main()
