"""Data that ships with shardlab (published measurements, with sources)."""
