"""One module per tool-call output format; `parsers.registry` names and detects them."""
