"""
Reading and writing: text to token ids and back, models to files and back.

    files.py          atomic writes: a failed write leaves the old file, never half of one
    tokenizer.py      byte-level BPE (train, encode, decode), saved as ``tokenizer.json``
    hf_tokenizer.py   Hugging Face ``tokenizer.json`` files through tiktoken
    safetensors.py    the safetensors file format, written from scratch
    checkpoint.py     save / load a nanollm checkpoint; bundled names; ``load`` for any kind of folder
    hf.py             Hugging Face model folders in and out (``load_hf``, ``export_hf``)
"""
