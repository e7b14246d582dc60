"""Dummy clients (Mooncake's dummy/real split): many light processes on one host share one real
client's memory and master connection. ``server.ClientServer`` is the real side (``kvplane
client-server``); ``client.DummyClient`` is what a light process holds (``setup_dummy``)."""
