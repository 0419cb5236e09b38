"""A conversation file: read back as written, and each bad input refused in one line naming the file and turn."""

import json

import pytest

from kvsim.models import conversation as cv
from kvsim.models.conversation import Conversation, ConversationError, Turn


def _write(tmp_path, doc, name="chat.json"):
    p = tmp_path / name
    if isinstance(doc, bytes):
        p.write_bytes(doc)
    else:
        p.write_text(doc if isinstance(doc, str) else json.dumps(doc), encoding="utf-8")
    return p


def test_round_trip(tmp_path):
    conv = Conversation("The key is 12345.", (Turn("What is the key?", "12345"), Turn("Say it again.")))
    back = cv.load_conversation(_write(tmp_path, conv.to_json()))
    assert back.context == conv.context and back.turns == conv.turns


@pytest.mark.parametrize("doc, words", [
    ({"context": "c", "turns": [{"question": "q"}, {"question": "  "}]}, "turn 2 is empty"),
    ({"context": "", "turns": [{"question": "q"}]}, "context is empty"),
    ({"context": "c", "turns": []}, "no turns"),
    ({"context": "c", "turns": [{"question": "q", "answer": ""}]}, "turn 1's answer is empty"),
    ({"context": "c", "turns": [{"question": "q", "reply": "a"}]}, "turn 1 has an unknown field 'reply'"),
    ({"context": "c", "turns": [{"answer": "a"}]}, "turn 1 has no 'question'"),
    ({"context": "c", "turns": "q"}, "'turns' must be a list"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_files(tmp_path, doc, words):
    p = _write(tmp_path, doc)
    with pytest.raises(ConversationError) as e:
        cv.load_conversation(p)
    message = str(e.value)
    assert "\n" not in message and str(p) in message and words in message


def test_not_utf8_and_not_json(tmp_path):
    with pytest.raises(ConversationError, match=r"chat.json: not UTF-8"):
        cv.load_conversation(_write(tmp_path, b'{"context": "\xff"}'))
    with pytest.raises(ConversationError, match=r"chat.json: not JSON \(line 1"):
        cv.load_conversation(_write(tmp_path, "{context"))


def test_answer_needed_where_the_truth_teacher_forces_it(tmp_path):
    p = _write(tmp_path, {"context": "c", "turns": [{"question": "q", "answer": "a"}, {"question": "r"}]})
    assert cv.load_conversation(p).turns[1].answer is None
    with pytest.raises(ConversationError, match="turn 2 has no answer"):
        cv.load_conversation(p, needs_answers=True)


def test_a_turn_past_the_context_left():
    conv = cv.parse_conversation({"context": "c", "turns": [{"question": "q"}, {"question": "r"}]}, "x.json")
    cv.check_lengths(conv, 100, [10, 18], 128)
    with pytest.raises(ConversationError, match=r"x.json: turn 2 is 19 tokens, longer than the 18"):
        cv.check_lengths(conv, 100, [10, 19], 128)
