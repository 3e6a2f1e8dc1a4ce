"""A router's side, run in its own process by test_publisher.py: subscribe, check the batch
sequence numbers, recover gaps through replay, print one JSON line with what it saw.

argv: pub endpoint, replay endpoint, topic, events expected, first and last seq to discard
on the SUB socket (a simulated loss; -1 -1 for none)."""

import json
import sys
import time

import msgpack
import zmq

pub, replay, topic, expected, lose_from, lose_to = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.RCVHWM, 0)
sub.connect(pub)
sub.setsockopt_string(zmq.SUBSCRIBE, topic)
dealer = ctx.socket(zmq.DEALER)
dealer.setsockopt(zmq.RCVTIMEO, 5000)
dealer.connect(replay)
time.sleep(0.3)  # the subscription reaches the publisher before the test publishes
print("ready", flush=True)
batches = {}
replayed = 0
deadline = time.time() + 15


total = 0


def store(seq, payload):
    """Keep a batch once, whichever way it came."""
    global total
    if seq in batches:
        return False
    batches[seq] = payload
    total += len(msgpack.unpackb(payload)[1])
    return True


def replay_from(start):
    global replayed
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    while True:
        _, seq, payload = dealer.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            return
        replayed += store(int.from_bytes(seq, "big"), payload)


while total < expected and time.time() < deadline:
    if sub.poll(2000):
        got_topic, seq, payload = sub.recv_multipart()
        assert got_topic == topic.encode()
        seq = int.from_bytes(seq, "big")
        if lose_from <= seq <= lose_to:
            continue  # lost on the way
        store(seq, payload)
        if len(batches) != max(batches) + 1:  # a gap: ask for the batches from the first missing one
            replay_from(min(s for s in range(max(batches) + 1) if s not in batches))
    else:
        replay_from(0)  # nothing new for a while: ask for anything missed, the end included
ids = []
for seq in sorted(batches):
    ts, events = msgpack.unpackb(batches[seq])[:2]
    for event in events:
        ids.append(event[1][0])
print(json.dumps({"seqs_contiguous": sorted(batches) == list(range(len(batches))), "events": len(ids),
                  "in_order": ids == list(range(len(ids))), "replayed": replayed, "batches": len(batches)}), flush=True)
