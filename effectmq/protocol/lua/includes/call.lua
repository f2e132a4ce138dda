-- call.lua: the state of one script call, in one table.

-- What the call read once (declared: the declared task hashes as a set; now, now_text:
-- Redis time; meta: the meta hash; events_on: whether events are written), what it
-- queued (writes, hints, adds by index in add_order, counts of settled tasks per state,
-- seq_base and seq_used: the sequence counter read and how many numbers it took), what
-- it changed that its later reads of Redis would not show (settled: token -> outcome;
-- touched: ids it settled; promoted: delayed tasks it moved to waiting), and the
-- receipts it reads and writes (receipt, receipt_keys, receipt_values, resend_was and
-- resend_text: the last resend deadline, anybody_waits); groups and caps: the group
-- changes it gathered (groups.lua, group_caps.lua). One line: the function
-- library assigns it again at the start of every call (scripts.library).
local call = {writes = {}, hints = {}, seq_used = 0, settled = {}, touched = {}, promoted = 0, counts = {}, adds = {}, add_order = {}, receipt_keys = {}}
