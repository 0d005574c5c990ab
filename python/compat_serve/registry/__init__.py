"""Several models in one server (#27): which models there are (entries from `--model`,
`--models-dir`, `--models FILE`), which one a request's `model` names (routing), and
which are resident (the hub: lazy loads, a memory budget, eviction). No MLX here."""
