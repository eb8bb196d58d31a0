"""The ``local-damage`` console script: one module per command group, shared option helpers."""
