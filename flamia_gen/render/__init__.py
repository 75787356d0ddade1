"""Render: jinja2 templates → reproducible CuTe-DSL sources in `generated/`."""

from .render import (RenderResult, check_generated, generated_dir, generated_path, render_all, render_variant,
                     source_sha256, templates_dir)

__all__ = ["RenderResult", "check_generated", "generated_dir", "generated_path", "render_all", "source_sha256",
           "render_variant", "templates_dir"]
