"""The docs test: every fenced block of README.md and docs/*.md runs or is marked (markdown.py)."""
