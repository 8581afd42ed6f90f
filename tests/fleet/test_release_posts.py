"""The release outbox splits what it sends into posts the control plane accepts: a few long
checkpoints must not make one post too large to ever be taken."""

from __future__ import annotations

from minimill.fleet.releases import MAX_RELEASE_POST_BYTES, next_post
from minimill.transport.protocol import Checkpoint, ChoiceProgress, ReleaseItem


def release(n: int, tokens: int) -> ReleaseItem:
    choice = ChoiceProgress(index=0, text="word " * tokens, token_ids=list(range(tokens)))
    return ReleaseItem(request_id=f"req_{n}", epoch=1, checkpoint=Checkpoint(choices=[choice]))


def test_posts_stay_under_the_byte_cap_and_send_everything_once() -> None:
    pending = [release(n, 60_000) for n in range(20)]  # ~0.7 MB of JSON each
    sent: list[str] = []
    while pending:
        post = next_post(pending)
        assert post, "a post is never empty"
        size = sum(len(item.model_dump_json()) for item in post)
        assert size <= MAX_RELEASE_POST_BYTES or len(post) == 1
        sent += [item.request_id for item in post]
        pending = pending[len(post):]
    assert sent == [f"req_{n}" for n in range(20)]


def test_small_releases_go_together_and_a_huge_one_goes_alone() -> None:
    small = [release(n, 10) for n in range(300)]
    assert len(next_post(small)) == 256  # the item cap
    huge = release(999, 600_000)  # one checkpoint above the byte cap
    assert len(huge.model_dump_json()) > MAX_RELEASE_POST_BYTES
    assert next_post([huge, *small]) == [huge]
    assert next_post([*small[:3], huge]) == small[:3]
