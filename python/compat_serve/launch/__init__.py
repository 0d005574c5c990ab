"""`compat-serve launch {claude,codex,opencode}`: a server and an agent client in one command.

The launcher starts a server (or uses `--url`), waits until it answers, runs the client in
the same terminal with the settings that point it at the server (environment variables,
`-c` overrides, a generated config file in a temp directory), and stops the server when the
client exits, exiting with the client's code. One module per client builds its settings
(`claude`, `codex`, `opencode`); `server` owns the server process, `client_process` the
client's, `command` ties them together.
"""
