"""Collectives: rebuilt process groups, the async plan, the replayer, its size and bandwidth math."""
