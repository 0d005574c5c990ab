"""`/dashboard`: a page that shows the server while it works (routes.py), the JSON it
polls (snapshot.py) and the last log lines (log_ring.py). Its files are in static/.

Nothing is imported here: the CLI starts the log ring (stdlib only) before MLX loads."""
