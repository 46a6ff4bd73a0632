"""HTML pages people read (the evaluation, leave-one-out and demo reports): Jinja2 templates in
foreshock/templates, one base page for the look, rendered with autoescape so that nothing a dataset
or a model names can inject markup."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"


@lru_cache(maxsize=1)
def _environment():
    import jinja2

    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES),
                              autoescape=jinja2.select_autoescape(["html", "j2"]), undefined=jinja2.StrictUndefined)


def render(template: str, **context) -> str:
    """The page `template` (a file of foreshock/templates) with `context`; a missing value raises."""
    return _environment().get_template(template).render(**context)
