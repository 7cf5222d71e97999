-- hand_back: what waits on a worker's hand-off list (batches:{worker}),
-- handed to it and never pulled, goes to the shared batches list, at its
-- pulling end (it has waited already), oldest pulled first: the worker left
-- or was found dead. All of it, in one step.
-- KEYS[1] batches:{worker}  KEYS[2] batches
-- Returns how many batches moved.
local moved = 0
while redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT') do
  moved = moved + 1
end
return moved
