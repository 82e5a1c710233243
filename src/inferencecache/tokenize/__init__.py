"""Server-side prompt tokenization: each model's own tokenizer and chat template.

Shared by the server (``LookupRoute.prompt_text``, contract-and-index.md §5.2 step 4) and the
gateway. Every tokenizer is loaded once at startup from ``<dir>/<model_id>/tokenizer.json``; no
request ever touches the file system.
"""

from inferencecache.tokenize.chat import (
    ChatTokenizer,
    TokenizerLoadError,
    TokenizerSet,
    load_tokenizer_dir,
)

__all__ = ["ChatTokenizer", "TokenizerLoadError", "TokenizerSet", "load_tokenizer_dir"]
