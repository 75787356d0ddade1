"""Render: jinja2 templates → reproducible CuTe-DSL sources in `generated/`."""

from .render import (RenderResult, check_generated, generated_dir, generated_path, render_all, render_variant,
                     templates_dir)

__all__ = ["RenderResult", "check_generated", "generated_dir", "generated_path", "render_all",
           "render_variant", "templates_dir"]
