"""pagedkv.interop: pagedkv memory as other libraries' tensors, and theirs as pagedkv's:
the ctypes DLPack producer (`dlpack`), tensor views of pools and table exports (`views`),
and `DeviceArray` (`device_array`), an array in a backend's memory read from any
`__dlpack__` producer.

May import: `pagedkv.backends`, `pagedkv.core`, `pagedkv.errors`.
"""
