"""One JSON line of long lists of integers parsed on many threads: the long-line path of
:mod:`packkit.jsonlines` (:func:`~packkit.jsonlines.json_tables` takes it for a chunk that is one line of
:data:`~packkit.jsonlines.LONG_LINE_BYTES` or more), imported only then.
"""

from __future__ import annotations

from .arrow import pyarrow

__all__ = ["LONG_LIST_BYTES", "one_long_line"]

#: A list of integers at least this long (bytes of text) is parsed apart from its line (:func:`one_long_line`).
LONG_LIST_BYTES = 1 << 20


def one_long_line(chunk: bytes, parse):
    """One JSON line whose long flat lists of integers (``"input_ids": [5, 6, ...]``, :data:`LONG_LIST_BYTES` of
    text or more) are parsed on pyarrow's threads, the rest of the line by its JSON reader; None where the line is
    anything else or a list is not plain integers (the caller parses the line whole, naming what is wrong).

    pyarrow parses a block on one thread, so one 128 MiB line took one core (1.76x the wall of the same bytes in
    short lines, load 8.5 on 2 cores). Each long list is cut out (the line keeps ``[]``), its commas made newlines
    and read as one CSV column of int64 on every thread (an empty value, a float, text or a value past int64 fails,
    and the line goes the usual way), then put back as the row's."""
    pa = pyarrow()
    import pyarrow.csv as pcsv
    import pyarrow.json as pj
    spans, at = [], 0
    while True:
        lo = chunk.find(b"[", at)
        if lo < 0:
            break
        hi = chunk.find(b"]", lo)
        if hi < 0:
            return None
        at = hi + 1
        if hi - lo < LONG_LIST_BYTES:
            continue
        body = chunk[lo + 1: hi]
        if any(body.find(c) >= 0 for c in (b"[", b"{", b'"')):  # nested or text: not a flat list of numbers
            return None
        head = chunk[max(0, lo - 4096): lo].rstrip()
        if not head.endswith(b":"):
            return None  # a list inside a list, or not a key's value
        key = head[:-1].rstrip()
        start = key.rfind(b'"', 0, len(key) - 1)
        if not key.endswith(b'"') or start < 0 or b"\\" in key[start:]:
            return None
        spans.append((key[start + 1: -1].decode("utf-8", "replace"), lo, hi, body))
    if not spans:
        return None
    skeleton, last = [], 0
    for _, lo, hi, _ in spans:  # the line with each long list emptied: "input_ids": []
        skeleton += [chunk[last: lo + 1], b"]"]
        last = hi + 1
    skeleton.append(chunk[last:])
    try:
        table = pj.read_json(pa.BufferReader(b"".join(skeleton)), parse_options=parse)
        if table.num_rows != 1:
            return None
        for key, _, _, body in spans:
            text = body.translate(None, b" \t\r\n").replace(b",", b"\n")
            values = pcsv.read_csv(pa.BufferReader(text), read_options=pcsv.ReadOptions(column_names=["v"]),
                                   parse_options=pcsv.ParseOptions(ignore_empty_lines=False),
                                   convert_options=pcsv.ConvertOptions(column_types={"v": pa.int64()})).column("v")
            if values.null_count or key not in table.column_names:
                return None
            field = table.schema.field(key)
            if not pa.types.is_list(field.type):
                return None
            vtype = field.type.value_type if not pa.types.is_null(field.type.value_type) else pa.int64()
            values = values.combine_chunks().cast(vtype)
            row = pa.ListArray.from_arrays(pa.array([0, len(values)], pa.int32()), values)
            table = table.set_column(table.schema.get_field_index(key), key, row.cast(pa.list_(vtype)))
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, UnicodeDecodeError):
        return None
    return table
