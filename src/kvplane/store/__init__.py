"""The store: a distributed KV pool. A master holds metadata only; bytes move client to segment."""
