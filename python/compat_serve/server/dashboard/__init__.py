"""`/dashboard`: a page that shows the server while it works (routes.py), the JSON it
polls (snapshot.py) and the last log lines (log_ring.py). Its files are in static/."""

from compat_serve.server.dashboard.routes import install

__all__ = ["install"]
