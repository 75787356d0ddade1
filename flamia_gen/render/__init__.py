"""Render: jinja2 templates → reproducible CuTe-DSL sources in `generated/`."""

from .render import (RenderResult, check_generated, generated_dir, generated_path, render_all, render_variant,
                     render_with_flags, rendered_literal, rendered_literals, rendered_params, source_sha256, templates_dir)

__all__ = ["RenderResult", "check_generated", "generated_dir", "generated_path", "render_all", "source_sha256",
           "render_variant", "render_with_flags", "rendered_literal", "rendered_literals", "rendered_params", "templates_dir"]
