"""The store master: pure metadata state (state.py), allocators, and the network front end."""
