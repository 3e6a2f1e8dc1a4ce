"""pagedkv.groups: layer groups of hybrid models below the cache: which layers form which
group and what each costs (`layout`: the per-group configs, the layer-to-group map, bytes per
token and per sequence, a byte budget split across groups), the recurrent-state slot pools
(`state_pools`) and the sliding-window arithmetic (`window`).

May import: `pagedkv.kv`, `pagedkv.interop`, `pagedkv.backends`, `pagedkv.codecs`, `pagedkv.core`,
`pagedkv.errors`
(tests/test_layering.py holds the table).
"""
