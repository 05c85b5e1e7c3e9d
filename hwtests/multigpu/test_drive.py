"""drive.py's arrivals: the same times for every url in step, independent ones out of step."""

import unittest

import drive


class Offsets(unittest.TestCase):
    def test_same_and_independent(self):
        urls = ["raw://a:1", "raw://b:2"]
        same = drive.offsets_for(urls, 5.0, 50, 1, "same")
        self.assertEqual(same[0], same[1])
        ind = drive.offsets_for(urls, 5.0, 50, 1, "independent")
        self.assertNotEqual(ind[0], ind[1])
        self.assertEqual(ind[0], same[0])  # the first url keeps the seed's own times
        for o in ind:
            self.assertEqual(o, sorted(o))
            self.assertAlmostEqual(len(o) / o[-1], 5.0, delta=2.0)

    def test_trace_windows(self):
        trace = [0.0, 0.1, 0.2, 5.0, 5.1, 9.0, 9.5, 12.0]
        same = drive.offsets_for(["x", "y"], 2.0, 6, 0, "same", trace)
        self.assertEqual(same[0], same[1])
        self.assertAlmostEqual(same[0][-1], 3.0)

    def test_bad_mode(self):
        with self.assertRaises(ValueError):
            drive.offsets_for(["x"], 1.0, 3, 0, "lockstep")

    def test_payload_is_a_raw_request(self):
        body = drive.payload(4, 8)
        self.assertEqual(len(body), drive.rawserver.HEADER.size + 16)
        magic, n, n_ids = drive.rawserver.HEADER.unpack_from(body)
        self.assertEqual((magic, n, n_ids), (b"VRQ1", 8, 4))


if __name__ == "__main__":
    unittest.main()
