"""kmix.tags.event_file: TensorBoard event files without TensorFlow (issue 24).

The reference is TensorFlow's own writer: the same text, scalar and layout summaries are
written with ``tf.summary`` and with :class:`EventWriter`, and both files are read back
with TensorBoard's ``EventFileLoader``. The JAX test runs in a subprocess (this process
has TensorFlow loaded) and checks that writing, reading and a monitored fit import no
TensorFlow.
"""

from __future__ import annotations

import glob
import importlib.util
import itertools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import summary as custom_scalar
from tensorboard.util import tensor_util

from kmix import tags
from kmix.callbacks._batch import SummaryBatch
from kmix.callbacks._layout import layout
from kmix.tags import event_file as _event_writer
from kmix.tags.event_file import EventWriter, read_events

TEXT = ("kmix/notes", "a **note** ü", 3, "what the notes say")
SCALAR = ("kmix/loss_scale", 32768.5, 4, "the loss scale")
PLAIN_SCALAR = ("kmix/skip_rate", 0.1, 5, None)  # float32-rounded, no description
PLAIN_TEXT = ("kmix/events", "", 6, None)
LAYOUT = layout()


def write_with_tf(directory: str) -> None:
    writer = tf.summary.create_file_writer(directory)
    with writer.as_default():
        for tag, text, step, description in (TEXT, PLAIN_TEXT):
            tf.summary.text(tag, text, step=step, description=description)
        for tag, value, step, description in (SCALAR, PLAIN_SCALAR):
            tf.summary.scalar(tag, value, step=step, description=description)
        tf.summary.experimental.write_raw_pb(custom_scalar.pb(LAYOUT).SerializeToString(), step=7)
    writer.close()


def write_with_kmix(directory: str) -> str:
    with EventWriter(directory) as writer:
        for tag, text, step, description in (TEXT, PLAIN_TEXT):
            writer.text(tag, text, step=step, description=description)
        for tag, value, step, description in (SCALAR, PLAIN_SCALAR):
            writer.scalar(tag, value, step=step, description=description)
        writer.layout(LAYOUT, step=7)
    return writer.path


def load(directory: str) -> list:
    (path,) = glob.glob(os.path.join(directory, "*tfevents*"))
    return list(event_file_loader.EventFileLoader(path).Load())


def test_text_scalar_and_layout_are_the_protos_tf_summary_writes(tmp_path):
    write_with_tf(str(tmp_path / "tf"))
    write_with_kmix(str(tmp_path / "kmix"))
    theirs, ours = load(str(tmp_path / "tf")), load(str(tmp_path / "kmix"))
    assert ours[0].file_version == theirs[0].file_version == "brain.Event:2"
    assert ours[0].wall_time > 0
    assert [e.step for e in ours[1:]] == [e.step for e in theirs[1:]] == [3, 6, 4, 5, 7]
    assert len(ours) == len(theirs) == 6
    for mine, reference in zip(ours[1:], theirs[1:], strict=True):
        assert mine.wall_time > 0
        (value,), (expected,) = mine.summary.value, reference.summary.value
        assert value.tag == expected.tag
        assert value.metadata.plugin_data.plugin_name == expected.metadata.plugin_data.plugin_name
        assert value.metadata.plugin_data.content == expected.metadata.plugin_data.content
        assert value.metadata.summary_description == expected.metadata.summary_description
        assert value.metadata.display_name == expected.metadata.display_name
        assert value.tensor.dtype == expected.tensor.dtype
        assert value.tensor.tensor_shape == expected.tensor.tensor_shape
        got, want = (tensor_util.make_ndarray(v.tensor) for v in (value, expected))
        assert got.dtype == want.dtype and got.shape == want.shape == ()
        assert got.tobytes() == want.tobytes() if got.dtype != object else got == want
        assert value.SerializeToString() == expected.SerializeToString()  # byte for byte


def test_the_values_read_back_are_those_written(tmp_path):
    path = write_with_kmix(str(tmp_path))
    events = list(read_events(path))  # kmix's reader agrees with TensorBoard's
    assert [e.step for e in events] == [e.step for e in load(str(tmp_path))]
    by_tag = {e.summary.value[0].tag: e for e in events[1:]}
    assert tensor_util.make_ndarray(by_tag[TEXT[0]].summary.value[0].tensor).item() == (
        TEXT[1].encode("utf-8")
    )
    assert tensor_util.make_ndarray(by_tag[SCALAR[0]].summary.value[0].tensor) == np.float32(
        SCALAR[1]
    )
    stored = by_tag["custom_scalars__config__"].summary.value[0].tensor.string_val[0]
    assert layout_pb2.Layout.FromString(stored) == LAYOUT
    assert events[0].source_metadata.writer == "kmix"


def test_two_writers_in_one_second_write_two_files_and_overwrite_none(tmp_path, monkeypatch):
    monkeypatch.setattr(_event_writer.time, "time", lambda: 1_700_000_000.25)
    monkeypatch.setattr(_event_writer, "_COUNTER", itertools.count())
    prefix = f"events.out.tfevents.1700000000.{_event_writer.socket.gethostname()}.{os.getpid()}"
    taken = tmp_path / f"{prefix}.1.kmix.v2"  # the second writer's first choice
    taken.write_bytes(b"not ours")
    first, second = EventWriter(str(tmp_path)), EventWriter(str(tmp_path))
    first.text("kmix/notes", "first", step=1)
    second.text("kmix/notes", "second", step=1)
    first.close()
    second.close()
    assert os.path.basename(first.path) == f"{prefix}.0.kmix.v2"
    assert os.path.basename(second.path) == f"{prefix}.2.kmix.v2"
    assert taken.read_bytes() == b"not ours"
    for writer, text in ((first, b"first"), (second, b"second")):
        (event,) = list(read_events(writer.path))[1:]
        assert event.summary.value[0].tensor.string_val == [text]
        assert event.wall_time == 1_700_000_000.25


def test_a_tensorflow_writer_beside_it_in_the_same_second_cannot_clobber_it(tmp_path):
    """TensorFlow truncates a file of the name it picks; its names never end in .kmix.v2."""
    ours = EventWriter(str(tmp_path))
    ours.text("kmix/notes", "kept", step=1)
    ours.close()
    for _ in range(3):
        tf.summary.create_file_writer(str(tmp_path)).close()
    assert len(glob.glob(str(tmp_path / "*tfevents*"))) == 4
    (event,) = list(read_events(ours.path))[1:]
    assert event.summary.value[0].tensor.string_val == [b"kept"]


def test_close_flushes_everything_and_a_closed_writer_refuses(tmp_path):
    writer = EventWriter(str(tmp_path / "new" / "train"))  # creates the directory
    for step in range(200):
        writer.scalar("kmix/loss_scale", 2.0**step, step=step)  # 2^128 on: inf, as TF
    writer.close()
    writer.close()  # again: nothing
    assert writer.closed
    events = list(read_events(writer.path))[1:]
    assert [e.step for e in events] == list(range(200))
    values = [tensor_util.make_ndarray(e.summary.value[0].tensor) for e in events]
    assert values == [np.float32(2.0**step) for step in range(128)] + [np.float32(np.inf)] * 72
    with pytest.raises(ValueError, match="is closed"):
        writer.text("kmix/notes", "late", step=1)


def test_flush_makes_the_points_readable_before_close(tmp_path):
    writer = EventWriter(str(tmp_path))
    writer.text("kmix/notes", "now", step=2)
    writer.flush()
    assert [e.step for e in read_events(writer.path)] == [0, 2]
    writer.close()


def test_the_reader_stops_at_a_record_cut_short_and_refuses_a_corrupt_one(tmp_path):
    path = write_with_kmix(str(tmp_path))
    whole = open(path, "rb").read()
    cut = tmp_path / "cut.tfevents"
    cut.write_bytes(whole[:-3])
    assert len(list(read_events(str(cut)))) == 5
    assert len(list(read_events(path, limit=2))) == 2
    corrupt = tmp_path / "corrupt.tfevents"
    corrupt.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))
    with pytest.raises(ValueError, match="checksum"):
        list(read_events(str(corrupt)))


def test_the_reader_reads_what_tensorflow_wrote(tmp_path):
    write_with_tf(str(tmp_path))
    (path,) = glob.glob(str(tmp_path / "*tfevents*"))
    assert [e.step for e in read_events(path)] == [e.step for e in load(str(tmp_path))]


def test_summary_batch_writes_the_values_tf_summary_scalar_writes(tmp_path):
    batch = SummaryBatch(lambda tag: f"about {tag}")
    batch.scalar("kmix/grad_norm", 1.25, step=3)
    batch.scalar("kmix/grad_norm", 0.1, step=4)
    with EventWriter(str(tmp_path / "kmix")) as writer:
        batch.write(writer)
    reference = tf.summary.create_file_writer(str(tmp_path / "tf"))
    with reference.as_default():
        tf.summary.scalar("kmix/grad_norm", 1.25, step=3, description="about kmix/grad_norm")
        tf.summary.scalar("kmix/grad_norm", 0.1, step=4)
    reference.close()
    ours, theirs = load(str(tmp_path / "kmix"))[1:], load(str(tmp_path / "tf"))[1:]
    assert [e.step for e in ours] == [e.step for e in theirs] == [3, 4]
    for mine, expected in zip(ours, theirs, strict=True):
        got, want = (tensor_util.make_ndarray(e.summary.value[0].tensor) for e in (mine, expected))
        assert got.dtype == want.dtype == np.float32 and got == want
    assert ours[0].summary.value[0].metadata == theirs[0].summary.value[0].metadata


def test_path_helpers(tmp_path):
    _event_writer.makedirs(str(tmp_path / "a" / "b"))
    _event_writer.makedirs(str(tmp_path / "a" / "b"))  # exists: nothing
    (tmp_path / "a" / "b" / "y.tfevents").write_bytes(b"")
    (tmp_path / "a" / "b" / "x.tfevents").write_bytes(b"")
    assert [os.path.basename(p) for p in _event_writer.glob(str(tmp_path / "a/b/*"))] == [
        "x.tfevents",
        "y.tfevents",
    ]
    assert _event_writer.glob(str(tmp_path / "missing" / "*")) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        _event_writer.makedirs(str(tmp_path / "file"))
    assert _event_writer.is_url("gs://bucket/run") and not _event_writer.is_url(str(tmp_path))


JAX_SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    import numpy as np
    import keras
    import kmix.callbacks.monitor
    from kmix import tags
    from kmix.tags import event_file as _event_writer
    from kmix.callbacks._prior_runs import begins_in

    directory = sys.argv[1]
    with _event_writer.EventWriter(directory + "/plain") as writer:
        writer.text("kmix/notes", "note", step=1)
        writer.scalar("kmix/loss_scale", 2.0, step=1)
    assert len(list(_event_writer.read_events(writer.path))) == 3

    keras.config.set_dtype_policy("mixed_float16")  # the stock loss-scale optimizer
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    monitor = kmix.callbacks.monitor.MixedPrecisionMonitor(directory, 1000, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):  # the second fit reads the first's file head
            model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[monitor])
    print(len(begins_in(directory + "/" + tags.TRAIN_DIR)), monitor.run_id is not None)
    print("tensorflow" in sys.modules)
    """
)


@pytest.mark.slow  # a subprocess importing Keras and JAX (~4 s)
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="JAX is not installed")
def test_on_jax_the_writer_and_a_monitored_fit_import_no_tensorflow(tmp_path):
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", JAX_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["2", "True", "False"]
    files = glob.glob(str(tmp_path / tags.TRAIN_DIR / "*tfevents*"))
    assert len(files) == 2 and all(f.endswith(".kmix.v2") for f in files)
