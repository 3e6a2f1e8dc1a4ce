"""The tier glue of `PrefixCache`: `_check_tier` (every call's check that its host and disk
tiers are still live: a released host tier's blocks are forgotten and the cache goes on
device-only, a closed disk tier's likewise, down to two tiers; a live disk tier's finished
writes are taken) and the tier queries (`host_tier`, `num_host_blocks`, `disk_tier`,
`num_disk_blocks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..tiers.disk_tier import DiskTier
    from ..tiers.host_tier import HostTier
    from .tiering import HostTiering


class PrefixTiers:
    """Mixed into `PrefixCache` (it sets `_tiering` and `_disk`)."""

    def _check_tier(self) -> HostTiering | None:
        """The tiering part while its host tier is live. Once the tier has been released,
        forget every host-resident block (a BlockRemoved on the CPU) and go on as a
        device-only cache (None)."""
        tiering = self._tiering
        if tiering is not None:
            if not tiering.tier.is_live():
                tiering.forget_all()
                self._tiering = tiering = None
                self._disk = None
            elif self._disk is not None:
                if self._disk.disk.is_bound():
                    self._disk.poll()
                else:  # the disk tier was closed first: forget its blocks, go on with two tiers
                    self._disk.forget_all()
                    tiering.disk = self._disk = None
        return tiering

    def host_tier(self) -> "HostTier | None":
        """The host tier evictions demote into, or None. Releasing the tier before the
        prefix cache is allowed: the next call forgets the host-resident blocks (one
        BlockRemoved on the CPU) and the cache goes on device-only."""
        return None if self._tiering is None else self._tiering.tier

    def num_host_blocks(self) -> int:
        """How many blocks the cache holds in the host tier (0 once the tier was released:
        the next call forgets them)."""
        tiering = self._tiering
        return 0 if tiering is None or not tiering.tier.is_live() else len(tiering.by_host)

    def disk_tier(self) -> "DiskTier | None":
        """The disk tier below the host tier, or None. Closing the disk tier before the
        prefix cache is allowed: the next call forgets the disk blocks (the directory keeps
        them) and the cache goes on with two tiers."""
        return None if self._disk is None else self._disk.disk

    def num_disk_blocks(self) -> int:
        """How many cached blocks have a copy in the disk tier (on disk only, or beside a
        device or host block)."""
        return 0 if self._disk is None else self._disk.num_blocks()
