"""Durable storage without networking: the source's spool (WAL and sealed Arrow files)
and the PZQ queue's message store (segment log, group commit)."""
