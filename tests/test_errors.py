"""One integer validator, :func:`packkit.errors.check_int`: the same mistake, met through any entry point,
raises the same class with the same wording (and so the same exit code on the command line).

Before the fix the integer check stood 21 times in 10 files behind 4 private helpers: ``batch_size=0``
raised ``ArgumentError`` from ``plan_budget`` but a bare ``ValueError`` from ``LengthGroupedSampler``, and
``seed=-1`` read "seed must be >= 0" in the collators but "seed must be a non-negative integer" in ``pack``.
"""

import numpy as np
import pytest

from packkit.binpack import pack
from packkit.collate import FixedWindowCollator, PaddedCollator
from packkit.errors import ArgumentError, ArgumentTypeError, check_int
from packkit.packer import pack_stream
from packkit.sampler import LengthGroupedSampler, PackedBatchSampler
from packkit.waste import measure_waste

datasets = pytest.importorskip("datasets")
from packkit.offline import pack_dataset  # noqa: E402

DS = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]})

#: (the mistake, its one wording, the entry points that meet it)
MISTAKES = [
    ("window=0", ArgumentError, "window must be at least 1 token, got 0", [
        lambda: pack([1, 2], window=0),
        lambda: FixedWindowCollator(window=0),
        lambda: PackedBatchSampler([1, 2], window=0),
        lambda: measure_waste([1, 2], window=0),
        lambda: pack_dataset(DS, window=0),
        lambda: list(pack_stream([{"input_ids": [1]}], window=0)),
    ]),
    ("window=2.0", ArgumentTypeError, "window must be an integer, got 2.0 (float)", [
        lambda: pack([1, 2], window=2.0),
        lambda: FixedWindowCollator(window=2.0),
        lambda: PackedBatchSampler([1, 2], window=2.0),
        lambda: pack_dataset(DS, window=2.0),
    ]),
    ("seed=-1", ArgumentError, "seed must be at least 0, got -1", [
        lambda: pack([1, 2], window=4, seed=-1),
        lambda: FixedWindowCollator(window=4, seed=-1),
        lambda: LengthGroupedSampler([1, 2], batch_size=1, seed=-1),
        lambda: pack_dataset(DS, window=4, seed=-1),
    ]),
    ("batch_size=0", ArgumentError, "batch_size must be at least 1, got 0", [
        lambda: LengthGroupedSampler([1, 2], batch_size=0),
        lambda: measure_waste([1, 2], window=4, batch_size=0),
    ]),
    ("buffer_size=True", ArgumentTypeError, "buffer_size must be an integer, got True (bool)", [
        lambda: measure_waste([1, 2], window=4, buffer_size=True),
        lambda: list(pack_stream([{"input_ids": [1]}], window=4, buffer_size=True)),
    ]),
    ("pad_token_id='0'", ArgumentTypeError, "pad_token_id must be an integer, got '0' (str)", [
        lambda: PaddedCollator(pad_token_id="0"),
        lambda: FixedWindowCollator(window=4, pad_token_id="0"),
    ]),
    ("num_proc=0", ArgumentError, "num_proc must be at least 1, got 0", [
        lambda: pack_dataset(DS, window=4, num_proc=0),
    ]),
]


@pytest.mark.parametrize("mistake, cls, wording, entry_points", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_one_mistake_one_class_one_wording(mistake, cls, wording, entry_points):
    for call in entry_points:
        with pytest.raises(ArgumentError) as info:
            call()
        assert type(info.value) is cls and str(info.value) == wording, (mistake, type(info.value), str(info.value))


def test_check_int_takes_numpy_integers_and_keeps_value_and_type_errors_apart():
    assert check_int(np.int64(3), "n") == 3 and type(check_int(np.int64(3), "n")) is int
    assert check_int(0, "rank", low=0, high=3) == 0
    with pytest.raises(ArgumentError, match="rank must be between 0 and 3, got 4"):
        check_int(4, "rank", low=0, high=3)
    with pytest.raises(TypeError):  # an ArgumentTypeError is a TypeError and a ValueError (ArgumentError)
        check_int(None, "n")


def test_an_options_object_of_the_wrong_kind_is_refused_by_name_at_every_door():
    """``pack_dataset`` and the samplers take their rarer knobs as an options object or as keywords, through one
    helper: an unknown keyword is Python's own ``TypeError``, and the other door's options object (an easy
    mistake: both are dataclasses of knobs) is refused naming the type each takes, not read field by field."""
    datasets = pytest.importorskip("datasets")
    from packkit.offline import PackOptions, pack_dataset
    from packkit.sampler import LengthGroupedSampler, SamplerOptions

    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]]})
    with pytest.raises(TypeError, match=r"pack_dataset\(options=\.\.\.\) takes a PackOptions, got SamplerOptions"):
        pack_dataset(ds, window=8, options=SamplerOptions())
    with pytest.raises(TypeError, match=r"takes a SamplerOptions, got PackOptions"):
        LengthGroupedSampler([3, 2], batch_size=1, options=PackOptions())
    with pytest.raises(TypeError, match=r"pack_dataset\(\) got an unexpected keyword argument 'windo'"):
        pack_dataset(ds, window=8, windo=3)
