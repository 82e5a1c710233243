"""Named prompt templates for RenderTemplate (contract-and-index.md §5.15): ``registry`` finds a
tenant's template file under ``serve --template-dir`` and re-reads it when it changes;
``render`` renders it in a sandbox with output and recursion bounds and names its stable part
(the text before the first variable).
"""

from inferencecache.templates.registry import TemplateRegistry
from inferencecache.templates.render import RenderError, Template, compile_template

__all__ = ["RenderError", "Template", "TemplateRegistry", "compile_template"]
