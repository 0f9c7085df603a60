"""The shapes a server compiles (`serving.buckets`): decode reading pages in place takes one bucket of pages, and
mixed steps take each decode bucket with each count of chunks, every bucket round-tripping through the host inputs it
runs on."""
import dataclasses

from starscream_jax.serving.buckets import Bucket, Buckets


def test_decode_reading_pages_in_place_takes_one_bucket_of_pages():
    """cuDNN's paged kernel reads a row's visible positions whatever the table's width: decode compiles the widest
    table only, prefill (which gathers) keeps its halvings."""
    gathering = Buckets.for_limits(rows=64, chunk=512, pages=512, prefill_rows=4)
    in_place = Buckets.for_limits(rows=64, chunk=512, pages=512, prefill_rows=4, reads_in_place=True)
    assert gathering.pages_of("decode") == gathering.pages_of("prefill") == (64, 128, 256, 512)
    assert in_place.pages_of("decode") == (512,) and in_place.pages_of("prefill") == (64, 128, 256, 512)
    assert {shape[3] for shape in in_place.shapes() if shape[0] == "decode"} == {512}
    assert (gathering.programs(), in_place.programs()) == (20, 11)


def test_mixed_steps_take_each_decode_bucket_with_each_count_of_chunks():
    """A mixed step of every decode bucket (rows and pages: decode's, so decode rows that gather copy no wider a
    table than in a decode step) with each `mixed_chunks` count of chunks of the largest positions bucket: 3 more
    programs where decode reads in place, 12 where it gathers; each round trips through the host inputs it runs
    on."""
    limits = dict(rows=64, chunk=512, pages=512, prefill_rows=4)
    in_place = dataclasses.replace(Buckets.for_limits(**limits, reads_in_place=True), mixed_chunks=(1,))
    gathering = dataclasses.replace(Buckets.for_limits(**limits), mixed_chunks=(1, 4))
    assert (in_place.programs(), gathering.programs()) == (11 + 3, 20 + 24)
    mixed = [bucket for bucket in in_place.shapes() if bucket.phase == "mixed"]
    assert {(bucket.rows, bucket.chunks, bucket.width, bucket.pages) for bucket in mixed} == {
        (rows, 1, 512, 512) for rows in (4, 16, 64)}
    assert in_place.rows_of("mixed") == (1,) and in_place.pages_of("mixed") == (512,)
    for bucket in mixed + [Bucket("decode", 4, 1, 512), Bucket("scored", 1, 512, 64)]:
        assert Bucket.of(bucket.phase, bucket.zeros()) == bucket
