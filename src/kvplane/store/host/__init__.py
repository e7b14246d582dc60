"""What makes a store client host a segment of the pool (``global_segment_size > 0``).

``segment`` carves the contributed memory out of the engine; ``repairs`` acknowledges the
master's fences and runs its re-replication tasks; ``adoption`` re-registers what the segment
holds after a remount and clears what the master forgot; ``disk_node`` is the segment's SSD tier.
Each is built from the client's ``ClientContext`` and sits above the client's layers below the
facade (``kvplane.store.client.LAYERS``); only ``kvplane.store.client.client`` imports them.
"""
