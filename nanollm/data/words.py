"""
Word lists for the synthetic tasks (written for this project; plain English words).

Keys of the needle tasks are "adjective-noun" compounds (RULER uses the same shape);
prose filler is built from subjects, verbs, objects and places; common-words extraction draws from
``CWE_WORDS``.
"""

ADJECTIVES = """
able acid angry brave bright broad calm cheap clean clever cold cool crisp curly damp dark deep dry dull
eager early easy empty fair fancy fast fierce flat fresh gentle giant glad gold grand green happy hard
heavy high hollow huge humble icy jolly keen kind large late lazy light little lively long loud lucky mad
mild modern narrow neat new nice noble odd old pale plain polite proud quick quiet rapid rare raw red rich
rough round royal rude sad safe sharp shiny short shy silent silly slow small smart smooth soft solid sour
spicy stale steep sticky stiff strong sunny sweet swift tall tame tender thick thin tidy tiny tough warm
weak wet wide wild wise witty young zesty
""".split()

NOUNS = """
actor anchor apple arrow badge baker banana barrel basket beach bear bell berry bird blade boat bottle
bread bridge brush bucket butter button cabin cactus camel candle canoe canyon carpet castle cat cedar
chair cheese cherry circle cliff clock cloud coast coin comet copper cotton crane crown crystal dancer
desert diamond dragon drum eagle engine falcon feather fern field flute forest fox garden ginger glove
goat harbor hammer hawk helmet honey horse island jacket jungle kettle kitten ladder lake lantern lemon
lion lizard marble meadow melon mirror monkey moon mountain needle ocean olive onion orange otter owl
panda parrot pearl pencil pepper piano pillow pirate planet plum pocket potato puzzle rabbit river robot
rocket saddle sailor salmon shadow shell silver spider spoon squirrel star stone storm sugar tiger tomato
tower train tulip turtle valley violin wagon walnut whale window wizard wolf zebra
""".split()

NAMES = """
Alice Bruno Clara David Elena Felix Grace Hugo Irene Jonas Karen Leo Maria Nadia Oscar Paula Quinn Rosa
Samuel Tara Ulrich Vera Walter Xenia Yusuf Zoe
""".split()

VERBS = """
carried painted found watched cleaned moved opened lifted counted visited measured fixed sold bought
described followed pushed pulled wrapped tested borrowed hid studied drew
""".split()

PLACES = """
the old mill|the market square|the river bank|the train station|the north gate|the quiet library|
the small farm|the harbor wall|the hill road|the village school|the stone bridge|the west tower|
the city park|the bakery|the museum|the workshop
""".replace("\n", "").split("|")

# Vocabulary of the common-words-extraction task: every word here is distinct from the others.
CWE_WORDS = sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS))

# The fixed noise line of the "noise" haystack (RULER's repeated filler).
NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
