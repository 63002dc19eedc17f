"""The experiment web app: a form generated from arguments.py, a SQLite store, the API and a live dashboard."""
