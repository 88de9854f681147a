"""Tiers below the paged KV pool: host memory and disk, for returning conversations."""
